"""The dashboard's pages: each module exposes `render(root, entries, selected)`."""

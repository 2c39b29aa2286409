"""An embedding model with sparse gradients, trained by plain SGD: torch's fused SGD refuses sparse
gradients, so the fused-optimizer knob makes this script fail, as it would if the user made the change."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
args = parser.parse_args()


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(1000, 32, sparse=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, ids, labels):
        logits = self.head(self.embedding(ids).mean(dim=1))
        return logits, torch.nn.functional.cross_entropy(logits, labels)


torch.manual_seed(0)
model = Bag()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ids = torch.randint(0, 1000, (args.steps, 16, 8), generator=torch.Generator().manual_seed(0))
labels = torch.randint(0, 4, (args.steps, 16), generator=torch.Generator().manual_seed(1))
for step in range(args.steps):
    _, loss = model(ids[step], labels[step])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"done: loss {loss.item():.4f}")

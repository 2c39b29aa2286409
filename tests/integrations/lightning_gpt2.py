"""The tiny GPT-2 as a LightningModule; also a Lightning script with no gpuprof in it, for `gpuprof run`.

    python lightning_gpt2.py ROOT_DIR     # 3 optimizer steps of 2 batches each
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from tiny_gpt2 import BATCH, RandomTokens, tiny_model


class TinyGpt2Module(L.LightningModule):
    """Keeps what Lightning itself saw: each training-step loss and the gradient norm before clipping."""

    def __init__(self):
        super().__init__()
        self.model = tiny_model()
        self.step_losses: list[float] = []
        self.norms_before_clipping: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.step_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_before_optimizer_step(self, optimizer):  # after unscaling, before Lightning clips
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms_before_clipping.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def quiet_trainer(**options) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **options)


if __name__ == "__main__":
    trainer = quiet_trainer(max_steps=3, accumulate_grad_batches=2, default_root_dir=sys.argv[1])
    trainer.fit(TinyGpt2Module(), torch.utils.data.DataLoader(RandomTokens(), batch_size=BATCH))

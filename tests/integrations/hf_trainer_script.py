"""A Hugging Face Trainer script with no gpuprof in it, for `gpuprof run`: `python hf_trainer_script.py OUTPUT_DIR`."""

import sys

from tiny_gpt2 import BATCH, RandomTokens, tiny_model
from transformers import Trainer, TrainingArguments

args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                         max_steps=3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens()).train()

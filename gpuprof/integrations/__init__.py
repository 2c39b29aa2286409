"""Callbacks for the trainers people already use (Hugging Face's Trainer, Lightning), recording through `gpuprof.profile`."""

"""Reading checkpoints and writing files: safetensors, the one loader, host expert stores, tokenizers and router traces."""

"""Rewrite a GGUF file so that its tensor data starts on a 64-byte boundary, once.

  moejax-align-gguf --model_dir=Qwen3-30B-A3B-Q4_K_M.gguf       # in place
  moejax-align-gguf --model_dir=in.gguf --out=aligned.gguf      # a new file

llama.cpp writes its tensors at 32-byte alignment, so in most GGUF files (every Q4_K_M
download) they start at 32 mod 64 bytes, where jax cannot map the file in place.
moejax-generate still runs such a file with --store=mmap: with --policy the engine reads
each expert it fetches from the file (a copy per fetch, none of the whole file); with every
expert resident they are copied into RAM (one warning line).  Aligned, the engine slices
the mapped file directly and the resident experts are the file's pages.  One string key ("moejax.pad") is added to the metadata and the rest
of the file moves by its size (under 100 bytes); llama.cpp reads the file as before.
In place, the whole file is rewritten: an interrupted run leaves it unreadable (use
--out to keep the original).
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from moejax.cli import app as cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "The GGUF file to align (the --model_dir=FILE.gguf "
                    "that moejax-generate runs).")
flags.DEFINE_string("out", None, "Write the aligned file here instead of rewriting "
                    "--model_dir in place (needs the file's size free on its disk).")


def main(_):
  path = FLAGS.model_dir
  if not path:
    raise cli.UsageError("--model_dir: give the GGUF file to align (--model_dir=FILE.gguf)")
  if not os.path.isfile(path):
    raise cli.UsageError(f"--model_dir={path}: no such GGUF file")
  from moejax.io.weights import gguf_align
  out = FLAGS.out or path
  at = gguf_align.offset(path)
  if at == 0 and out == path:
    print(f"{path}: its tensor data already starts on a 64-byte boundary; nothing to do")
    return 0
  t0 = time.time()
  print(f"[moejax] rewriting {path} -> {out} ({os.path.getsize(path) / 1e9:.2f} GB; its data "
        f"starts at {at} mod 64 bytes) ...", file=sys.stderr)
  shift = gguf_align.align(path, out=out)
  print(f"{out}: tensor data moved by {shift} bytes to a 64-byte boundary in "
        f"{time.time() - t0:.1f} s; moejax maps it in place")
  return 0


def entry():
  """The console script `moejax-align-gguf`."""
  cli.run(main)


if __name__ == "__main__":
  entry()

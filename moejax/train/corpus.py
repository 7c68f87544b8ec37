"""A multi-domain corpus assembled from text every machine of this kind has on disk.

Domains (each a list of documents; a document is one file or one help topic):

* ``python``: the ``.py`` files of the running interpreter's standard library
  (``moejax.train.data.stdlib_files``; the same files and split as the first demo model).
* ``c``: C headers: the interpreter's own (``sysconfig include``), then ``/usr/include``.
* ``english``: prose: pydoc's help topics (``pydoc_data.topics``, one document per
  topic), the ``.txt``/``.rst``/``.md`` files of the standard library, the licence texts
  in ``/usr/share/common-licenses`` and the ``README*``/``NEWS*`` files under
  ``/usr/share/doc`` (gzip ones decompressed).

Files are taken in sorted path order; a document longer than ``max_doc_chars`` is cut,
and a domain stops once it holds ``cap_chars`` characters (``python`` files are kept whole
and empty ones kept, exactly as the first demo model's corpus).  Each document is held out
when ``sha1(its relative path) % 100 < 5`` (``moejax.train.data.is_heldout``), so the
``python`` held-out files are exactly the first demo model's.  The manifest records
every domain's file-list sha256, so two machines can check they built the same corpus.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import sysconfig

from moejax.train import data

DOMAINS = ("python", "c", "english")


def _read(path: str) -> str:
  if path.endswith(".gz"):
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
      return f.read()
  return data.read_text(path)


def _walk(root: str, suffixes: tuple[str, ...], skip_dirs=()) -> list[str]:
  out = []
  for dp, dn, fn in os.walk(root):
    dn[:] = sorted(d for d in dn if d not in skip_dirs and d != "__pycache__")
    out += [os.path.join(dp, f) for f in fn if f.endswith(suffixes)]
  return sorted(out)


def domain_sources(domain: str) -> list[tuple[str, str]]:
  """(relative name, absolute path or 'topic:NAME') of every candidate document, in order."""
  if domain == "python":
    root, rel = data.stdlib_files()
    return [(r, os.path.join(root, r)) for r in rel]
  if domain == "c":
    out = []
    for name, root in (("python-include", sysconfig.get_paths()["include"]),
                       ("usr-include", "/usr/include")):
      if os.path.isdir(root):
        out += [(f"{name}/{os.path.relpath(p, root)}", p) for p in _walk(root, (".h",))]
    return out
  if domain == "english":
    from pydoc_data import topics
    out = [(f"pydoc-topic/{k}", f"topic:{k}") for k in sorted(topics.topics)]
    stdlib = sysconfig.get_paths()["stdlib"]
    out += [(f"stdlib/{os.path.relpath(p, stdlib)}", p)
            for p in _walk(stdlib, (".txt", ".rst", ".md"), ("site-packages", "dist-packages"))]
    lic = "/usr/share/common-licenses"
    if os.path.isdir(lic):
      out += [(f"licenses/{f}", os.path.join(lic, f)) for f in sorted(os.listdir(lic))
              if os.path.isfile(os.path.join(lic, f))]
    docs = sorted(glob.glob("/usr/share/doc/*/README*") + glob.glob("/usr/share/doc/*/NEWS*"))
    out += [(f"doc/{os.path.relpath(p, '/usr/share/doc')}", p) for p in docs
            if os.path.isfile(p) and not os.path.islink(p)]
    return out
  raise ValueError(f"unknown corpus domain {domain!r}; known: {', '.join(DOMAINS)}")


def _text(src: str) -> str:
  if src.startswith("topic:"):
    from pydoc_data import topics
    return topics.topics[src[len("topic:"):]]
  return _read(src)


def build(domains=DOMAINS, cap_chars: int = 12_000_000, max_doc_chars: int = 200_000,
          python_cap: int | None = None):
  """Returns ({domain: (train_texts, heldout_texts)}, manifest).

  ``cap_chars`` bounds every domain but ``python`` (``python_cap``, default no bound).
  """
  out, manifest = {}, {"domains": {}}
  for dom in domains:
    cap = python_cap if dom == "python" else cap_chars
    train, held, names, chars = [], [], [], 0
    for rel, src in domain_sources(dom):
      try:
        txt = _text(src)
      except OSError:
        continue
      if dom != "python":           # python files stay whole: the first demo model's split
        if not txt.strip():
          continue
        txt = txt[:max_doc_chars]
      (held if data.is_heldout(rel) else train).append(txt)
      names.append(rel)
      chars += len(txt)
      if cap and chars >= cap:
        break
    out[dom] = (train, held)
    manifest["domains"][dom] = {
        "documents": len(names), "train_documents": len(train), "heldout_documents": len(held),
        "chars": chars, "file_list_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest()}
  manifest["heldout_rule"] = "sha1(relative path) % 100 < 5"
  manifest["cap_chars"], manifest["max_doc_chars"] = cap_chars, max_doc_chars
  return out, manifest

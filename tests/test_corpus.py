"""The multi-domain corpus: deterministic, the same python split as the first demo model."""

import pytest

from moejax.train import corpus, data


def test_python_domain_is_the_stdlib_split():
  root, rel = data.stdlib_files()
  names = [r for r, _ in corpus.domain_sources("python")]
  assert names == rel


@pytest.mark.parametrize("domain", ["c", "english"])
def test_domains_have_documents_and_a_cap(domain):
  assert len(corpus.domain_sources(domain)) > 20
  parts, man = corpus.build([domain], cap_chars=200_000, max_doc_chars=20_000)
  train, held = parts[domain]
  assert man["domains"][domain]["chars"] >= 200_000
  assert man["domains"][domain]["chars"] < 200_000 + 20_000
  assert all(len(t) <= 20_000 for t in train + held)
  again, man2 = corpus.build([domain], cap_chars=200_000, max_doc_chars=20_000)
  assert again == parts and man2 == man


def test_unknown_domain_names_the_choices():
  with pytest.raises(ValueError, match="python, c, english"):
    corpus.build(["rust"])

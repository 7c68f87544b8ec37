"""launch.generate as a user meets it: exit codes and the one line each mistake prints.

Exit 2: a usage error (one line naming the flag + a pointer to --help, no traceback);
exit 1: a checkpoint that cannot be read (one line naming the file/tensor; the
traceback only with --verbose); exit 0: success.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")


def run(*args, timeout=600):
  proc = subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def assert_usage_error(args, *needles):
  rc, _, err = run(*args)
  assert rc == 2, err
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert len(lines) == 2 and lines[0].startswith("python -m launch.generate: error: "), err
  assert "--help" in lines[1]
  for n in needles:
    assert n in lines[0], (n, lines[0])


def model_folder(tmp_path, config=True, tokenizer=True):
  d = tmp_path / "model"
  d.mkdir()
  if config:
    shutil.copy(os.path.join(DEMO, "config.json"), d / "config.json")
  if tokenizer:
    shutil.copy(os.path.join(DEMO, "tokenizer.json"), d / "tokenizer.json")
  return d


# ------------------------------------------------------------------ --model_dir
def test_missing_model_dir_is_an_error_not_a_random_model(tmp_path):
  assert_usage_error([f"--model_dir={tmp_path / 'nope'}"], "--model_dir=", "no such folder",
                     "--random_model")


def test_model_dir_without_config_json(tmp_path):
  d = model_folder(tmp_path, config=False)
  assert_usage_error([f"--model_dir={d}"], "has no config.json")


def test_model_dir_that_is_a_file(tmp_path):
  f = tmp_path / "model.safetensors"
  f.write_bytes(b"x")
  assert_usage_error([f"--model_dir={f}"], "is a file")


def test_model_dir_without_tokenizer(tmp_path):
  d = model_folder(tmp_path, tokenizer=False)
  assert_usage_error([f"--model_dir={d}"], "has no tokenizer.json")


def test_random_model_and_model_dir_together():
  assert_usage_error(["--random_model", f"--model_dir={DEMO}"], "--random_model",
                     "--model_dir")


# ------------------------------------------------------------------ flag combinations
@pytest.mark.parametrize("flag", ["--cache_fraction=0.5", "--cache_bytes=1000000", "--link=scaled",
                                  "--tau=0.2", "--admission_beta=0.5", "--eviction=lfu"])
def test_offload_flag_without_policy(flag):
  assert_usage_error([flag], flag.split("=")[0] + " applies only with --policy",
                     "--policy=quality")


def test_mapped_store_without_policy_reads_every_expert_in_place():
  """--store=mmap without --policy: the plan counts no expert in anonymous RAM (they are
  page cache), and the run generates from the mapped file."""
  rc, out, err = run("--store=mmap", "--max_new_tokens=4", "--prompt=def f(x):",
                     "--nostream")
  assert rc == 0, err
  assert "every expert read where the store holds it" in err
  assert "page cache     up to" in err and out.startswith("def f(x):")

def test_several_offload_flags_without_policy_are_all_named():
  assert_usage_error(["--cache_fraction=0.5", "--link=native"],
                     "--cache_fraction, --link apply only with --policy")


@pytest.mark.parametrize("policy", ["baseline", "speed"])
def test_tau_with_a_policy_that_ignores_it(policy):
  assert_usage_error([f"--policy={policy}", "--tau=0.3"], "--tau applies to the threshold rule",
                     f"--policy={policy}", "ignores it")


def test_admission_beta_with_baseline():
  assert_usage_error(["--policy=baseline", "--admission_beta=0.5"], "--admission_beta",
                     "waits for every miss")


def test_cache_fraction_and_cache_bytes_together():
  assert_usage_error(["--policy=quality", "--cache_fraction=0.5", "--cache_bytes=100000000"],
                     "give one")


def test_sampling_flags_with_greedy():
  assert_usage_error(["--top_p=0.9"], "--temperature=0", "--temperature > 0")


@pytest.mark.parametrize("args,needle", [
    (["--policy=quality", "--cache_fraction=0", "--dry_run"], "--cache_fraction must be in (0, 1]"),
    (["--policy=quality", "--cache_bytes=10", "--dry_run"], "--cache_bytes=10 holds 0 expert slots"),
    (["--policy=quality", "--link=fast", "--dry_run"], "--link='fast': cannot parse"),
    (["--policy=nope"], "--policy: unknown policy or preset 'nope'"),
    (["--max_new_tokens=0"], "flag --max_new_tokens=0: 0 is not a positive integer"),
    (["--max_len=1"], "--max_len must be >= 2, got 1"),
    (["--temperature=-1"], "flag --temperature=-1: -1.0 is not a non-negative number"),
    (["--temperature=1", "--top_p=1.5"], "--top_p must be in (0, 1], got 1.5"),
    (["--random_model", "--prompt="], "--prompt encodes to no tokens"),
])
def test_bad_values_name_their_flag(args, needle):
  assert_usage_error(args, needle)


def test_an_unknown_policy_lists_every_choice_auto_included():
  assert_usage_error(["--policy=bogus"], "--policy: unknown policy or preset 'bogus'",
                     "choose one of quality, speed, baseline, fetch_all", ", cost, auto")


# ------------------------------------------------------------------ context length
def test_prompt_longer_than_max_len_names_the_flag():
  assert_usage_error(["--random_model", "--prompt=" + "x" * 40, "--max_len=16"],
                     "--prompt is 40 tokens", "context of 16 (--max_len)", "raise --max_len")


def test_prompt_plus_new_tokens_over_max_len_says_how_many_fit():
  assert_usage_error(["--random_model", "--prompt=" + "x" * 10, "--max_len=16",
                      "--max_new_tokens=8"], "lower --max_new_tokens to 6 or raise --max_len")


def test_prompt_longer_than_the_models_own_limit():
  # the random model's limit (max_position_embeddings) is 2048 positions
  assert_usage_error(["--random_model", "--prompt=" + "x" * 3000],
                     "context of 2048 (the model's limit)")


def test_max_len_defaults_to_the_model_limit_and_larger_warns():
  rc, _, err = run("--random_model", "--max_len=4096", "--dry_run")
  assert rc == 0, err
  assert "warning: --max_len=4096 is beyond the model's limit of 2048" in err
  rc, _, err = run("--random_model", "--dry_run")
  assert rc == 0 and "warning" not in err, err


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("args,needle", [
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["--dtype=int8"], "--dtype=int8: value should be one of"),
    (["--store=disk", "--policy=quality"], "--store=disk: value should be one of"),
    (["--max_new_tokens=many"], "--max_new_tokens"),
    (["def f():"], "unexpected argument 'def f():'"),
])
def test_parse_errors_are_one_line_exit_2(args, needle):
  assert_usage_error(args, needle)


def test_help_exits_0_and_lists_the_flags():
  rc, out, _ = run("--help")
  assert rc == 0
  for f in ("--model_dir", "--policy", "--store", "--cache_bytes", "--max_len", "--verbose",
            "--lam", "--expert_devices", "--profile"):    # own, flagsets' groups, cli.app's
    assert f in out, f
  assert "(a positive integer)" in out                  # --max_new_tokens' bound, in its help


@pytest.mark.parametrize("module,asked,not_asked", [
    ("launch.serve", ("--cache_fraction", "--store", "--dtype", "--[no]verbose"), ("--lam",)),
    ("launch.host_ms", ("--model_dir", "--iters", "--[no]verbose"), ("--cache_fraction",)),
])
def test_help_lists_the_shared_flags_a_program_asked_for_and_no_others(module, asked, not_asked):
  proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  for f in asked:
    assert f in proc.stdout, f
  for f in not_asked:
    assert f not in proc.stdout, f


def test_a_bound_in_a_flag_declaration_is_a_one_line_usage_error():
  proc = subprocess.run([sys.executable, "-m", "launch.host_ms", "--iters=0"], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert "flag --iters=0: 0 is not a positive integer" in proc.stderr.splitlines()[0]


# ------------------------------------------------------------------ checkpoint errors
def _save_partial_checkpoint(d):
  from moejax.io.safetensors_io import save_file
  save_file({"model.embed_tokens.weight": np.zeros((8192, 128), np.float32)},
            str(d / "model.safetensors"))


def test_missing_tensor_is_one_line_exit_1_traceback_only_with_verbose(tmp_path):
  d = model_folder(tmp_path)
  _save_partial_checkpoint(d)
  rc, _, err = run(f"--model_dir={d}")
  assert rc == 1, err
  assert "Traceback" not in err
  assert "error: " in err and "missing tensor 'model." in err and str(d) in err
  assert "--verbose" in err
  rc, _, err = run(f"--model_dir={d}", "--verbose")
  assert rc == 1 and "Traceback" in err and "missing tensor 'model." in err


def test_truncated_safetensors_names_the_file(tmp_path):
  d = model_folder(tmp_path)
  with open(os.path.join(DEMO, "model.safetensors"), "rb") as f:
    (d / "model.safetensors").write_bytes(f.read(4096))
  rc, _, err = run(f"--model_dir={d}")
  assert rc == 1 and "Traceback" not in err, err
  assert f"{d / 'model.safetensors'}: truncated" in err


def test_corrupt_config_json_names_the_file(tmp_path):
  d = model_folder(tmp_path, config=False)
  (d / "config.json").write_text("{not json")
  rc, _, err = run(f"--model_dir={d}")
  assert rc == 1 and "Traceback" not in err, err
  assert f"{d / 'config.json'}: not valid JSON" in err


def test_unsupported_model_type_names_the_field(tmp_path):
  d = model_folder(tmp_path, config=False)
  cfg = json.load(open(os.path.join(DEMO, "config.json")))
  cfg["model_type"] = "llama"
  (d / "config.json").write_text(json.dumps(cfg))
  rc, _, err = run(f"--model_dir={d}")
  assert rc == 1 and "unsupported model_type 'llama'" in err, err


# ------------------------------------------------------------------ success paths
def test_dry_run_prints_host_and_device_memory_per_store():
  for store, host in (("numpy", "in RAM for every expert"), ("mmap", "0 B of experts kept in RAM"),
                      ("pinned_host", "in pinned host memory")):
    rc, out, err = run("--policy=quality", f"--store={store}", "--dry_run")
    assert rc == 0, err
    assert "host RAM" in err and host in err
    # the demo model: 8 layers x (16 slots + scratch) x 3 x 128 x 32 x 4 bytes (f32)
    assert f"expert cache {8 * 17 * 3 * 128 * 32 * 4 / 1e6:.2f} MB" in err
    assert out == ""


def test_offloaded_generation_from_a_random_model_in_an_mmap_store():
  rc, out, err = run("--random_model", "--policy=quality", "--store=mmap", "--link=native",
                     "--cache_bytes=200000", "--max_new_tokens=3", "--prompt=ab")
  assert rc == 0, err
  assert out.startswith("ab")
  assert err.index("device memory") < err.index("loaded in")   # the plan comes before loading
  assert "experts in a mmap store" in err and "hit rate" in err


# ------------------------------------------------------------------ streaming
@pytest.mark.parametrize("args", [
    [],                                                         # every expert resident
    ["--policy=quality", "--link=native"],                      # on-device loop unless streamed
], ids=["resident", "offload-native"])
def test_streamed_text_is_the_text_printed_at_the_end(args):
  common = ["--max_new_tokens=24", "--prompt=def add(a, b):", *args]
  rc, streamed, err = run("--stream", *common)
  assert rc == 0, err
  rc, whole, err = run("--nostream", *common)
  assert rc == 0, err
  assert streamed == whole and whole.startswith("def add(a, b):") and whole.endswith("\n")
  assert "24 tokens generated (1 from the prompt pass + 23 decode steps)" in err, err


class _Recorder:
  """A stdout that records each write, and whether a terminal is claimed."""

  def __init__(self, tty=False):
    self.writes, self.tty, self.events = [], tty, None

  def write(self, text):
    self.writes.append(text)
    if self.events is not None:
      self.events.append(("write", text))

  def flush(self):
    pass

  def isatty(self):
    return self.tty


def _fake_generate(ids, events):
  def generate(on_token):
    for t in ids:
      events.append(("token", t))
      if on_token:
        on_token(t)
    return list(ids)
  return generate


@pytest.fixture()
def gen_flags():
  from absl import flags
  from absl.testing import flagsaver
  from moejax.cli import generate as G
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["generate"])
  with flagsaver.flagsaver(prompt="x = '"):
    yield G


@pytest.mark.parametrize("tty,stream,streams", [(True, None, True), (False, None, False),
                                                (False, True, True), (True, False, False)])
def test_text_streams_by_default_only_to_a_terminal(gen_flags, monkeypatch, tty, stream, streams):
  from absl.testing import flagsaver
  from moejax.io.tokenizer import ByteTokenizer
  out, events = _Recorder(tty), []
  out.events = events
  monkeypatch.setattr(sys, "stdout", out)
  ids = list("héllo €".encode())            # multi-byte characters split over tokens
  with flagsaver.flagsaver(stream=stream):
    got = gen_flags.write_text(ByteTokenizer(), _fake_generate(ids, events))
  assert got == ids
  assert "".join(out.writes) == "x = 'héllo €\n"            # the same text either way
  assert all("\ufffd" not in w for w in out.writes)         # no half characters shown
  if streams:
    # each character is written once its last byte came, before the next token
    first_write = next(i for i, e in enumerate(events) if e[0] == "write" and e[1] == "h")
    assert events[first_write - 1] == ("token", ord("h"))
    assert len([w for w in out.writes if w]) >= len("héllo €")
  else:
    assert [e[0] for e in events] == ["token"] * len(ids) + ["write"] * len(out.writes)


def test_stream_of_the_demo_tokenizer_matches_decode_for_any_tokens():
  from moejax.cli.stream import TextStream
  from moejax.io.tokenizer import Tokenizer
  tok = Tokenizer(os.path.join(DEMO, "tokenizer.json"))
  rng = np.random.default_rng(0)
  texts = ["def f():\n    return 'naïve ☃ 😀'\n", "x = 1  # ∑ over ε\n\tprint(x)"]
  seqs = [tok.encode(t) for t in texts] + [rng.integers(0, tok.vocab_size, 300).tolist()]
  for ids in seqs:
    out = _Recorder()
    s = TextStream(tok, out, prefix=">>")
    for t in ids:
      s.add(t)
    s.finish()
    s.finish()                                 # once only
    assert "".join(out.writes) == ">>" + tok.decode(ids) + "\n"
    assert len(out.writes) > len(ids) // 4    # as the tokens come, not at the end

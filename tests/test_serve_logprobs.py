"""logprobs, echo and the penalties (issue 47 item 5) with the openai client against a
server started here: lm-evaluation-harness's local-completions log-likelihood request,
checked against log-probabilities computed directly with the resident model."""


import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.test_serve import DEMO, PROMPT, Server, baseline  # noqa: E402

CONT = " return fibonacci(n - 1)"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Server(tmp_path_factory.mktemp("logprobs"))
  try:
    yield s
  finally:
    s.stop()


@pytest.fixture(scope="module")
def exact():
  """ids -> [T, V] log-softmax of the model over every expert (one full forward)."""
  import jax
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.model import Transformer
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  model, experts = Transformer(cfg, jnp.float32), store.to_device(jnp.float32)

  def run(ids):
    logits, _, _ = model.apply({"params": params}, jnp.asarray([ids]), experts)
    return np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
  run.tok = Tokenizer(DEMO)
  return run


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(server, exact, max_tokens):
  # what lm-eval's local-completions sends for a log-likelihood request (tokenized, batch 1)
  ctx, cont = exact.tok.encode(PROMPT), exact.tok.encode(CONT)
  ids = ctx + cont
  r = server.client().completions.create(model="demo", prompt=[ids], temperature=0,
                                         max_tokens=max_tokens, logprobs=1, seed=1234,
                                         echo=True)
  choice = r.choices[0]
  lp = choice.logprobs
  n = len(ids) + max_tokens
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  want = exact(ids)
  ref = [want[p - 1, ids[p]] for p in range(1, len(ids))]
  np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], ref, atol=2e-4)
  for p in range(1, len(ids)):          # the top alternative is the argmax's log-prob
    (best,) = lp.top_logprobs[p].values()
    assert abs(best - want[p - 1].max()) < 2e-4
  assert choice.text.startswith(PROMPT + CONT) and lp.text_offset[0] == 0
  assert lp.text_offset == sorted(lp.text_offset)
  assert lp.text_offset[len(ctx)] == len(PROMPT)
  assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
  # lm-eval's parse: the continuation's log-likelihood and whether it is greedy
  toks = lp.token_logprobs[len(ctx):len(ctx) + len(cont)]
  assert sum(toks) == pytest.approx(sum(ref[len(ctx) - 1:]), abs=1e-3)
  greedy = all(t == max(top.values()) for t, top in
               zip(toks, lp.top_logprobs[len(ctx):len(ctx) + len(cont)]))
  assert greedy == all(want[p - 1].argmax() == ids[p] for p in range(len(ctx), len(ids)))
  if max_tokens:               # the generated token: from the (exact) prompt pass's logits
    assert lp.token_logprobs[-1] == pytest.approx(want[-1].max(), abs=2e-4)


def test_generated_logprobs_leave_the_tokens_as_they_were(server):
  c = server.client()
  plain = c.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0,
                               **baseline())
  r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0,
                           logprobs=3, **baseline())
  assert r.choices[0].text == plain.choices[0].text
  lp = r.choices[0].logprobs
  assert len(lp.tokens) == 10 and lp.text_offset[0] == 0
  for t, top in zip(lp.token_logprobs, lp.top_logprobs):
    assert len(top) <= 3 and t == max(top.values()) and t <= 0     # greedy: the best
  assert "".join(lp.tokens) == r.choices[0].text
  echo = c.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                              echo=True, **baseline())
  assert echo.choices[0].text == PROMPT + plain.choices[0].text[:len(
      echo.choices[0].text) - len(PROMPT)] and echo.choices[0].logprobs is None


def test_chat_logprobs(server):
  c = server.client()
  msgs = [{"role": "user", "content": "fibonacci"}]
  # baseline: exact decoding, so the shared cache's state cannot change the tokens
  r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=5, temperature=0,
                                logprobs=True, top_logprobs=2, **baseline())
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens == 5
  for e in content:
    assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
    assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
  plain = c.chat.completions.create(model="demo", messages=msgs, max_tokens=5, temperature=0,
                                    logprobs=False, **baseline())
  assert plain.choices[0].logprobs is None
  assert plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("route,kw,match", [
    ("chat", dict(logprobs=True, top_logprobs=6), "top_logprobs.*<= 5"),
    ("chat", dict(top_logprobs=2), "needs 'logprobs'"),
    ("completions", dict(logprobs=6), "logprobs.*<= 5"),
    ("completions", dict(presence_penalty=2.5), "presence_penalty.*<= 2"),
    ("completions", dict(frequency_penalty=-3), "frequency_penalty.*>= -2"),
    ("completions", dict(logprobs=1, stream=True), "without 'stream'"),
    ("completions", dict(max_tokens=0), "max_tokens"),
])
def test_out_of_range_fields_get_400(server, route, kw, match):
  c = server.client()
  with pytest.raises(openai.BadRequestError, match=match):
    if route == "chat":
      c.chat.completions.create(model="demo", max_tokens=2,
                                messages=[{"role": "user", "content": "x"}], **kw)
    else:
      c.completions.create(**dict(dict(model="demo", prompt=PROMPT, max_tokens=2), **kw))


def test_penalties(server):
  c = server.client()
  kw = dict(model="demo", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
            **baseline())
  plain = c.completions.create(**kw).choices[0]
  zero = c.completions.create(presence_penalty=0, frequency_penalty=0, **kw).choices[0]
  assert zero.text == plain.text
  pen = c.completions.create(frequency_penalty=2, presence_penalty=1, **kw).choices[0]
  most = lambda ch: max(ch.logprobs.tokens.count(t) for t in ch.logprobs.tokens)
  assert pen.text != plain.text and most(pen) < most(plain), (plain.text, pen.text)


def test_the_penalized_sampler():
  import jax
  from moejax.model.sampler import next_token_penalized
  logits = np.asarray([3.0, 2.5, 0.0, -1.0], np.float32)
  counts = np.asarray([1, 0, 0, 3], np.int32)
  key = jax.random.PRNGKey(0)
  f = lambda c, p, q: int(next_token_penalized(logits, c, key, np.float32(p), np.float32(q),
                                               0.0, 1.0)[0])
  assert f(counts, 0.0, 0.0) == 0
  assert f(counts, 0.6, 0.0) == 1                 # 3 - 0.6 < 2.5
  assert f(counts, 0.0, 0.6) == 1                 # 3 - 0.6 * 1 < 2.5
  assert f(counts, 0.0, 0.4) == 0                 # 3 - 0.4 * 1 > 2.5
  assert f(np.asarray([4, 0, 0, 0], np.int32), 0.0, 0.2) == 1
  assert f(np.asarray([0, 0, 0, 3], np.int32), 0.0, -2.0) == 3     # negative: repeats
  tok, new = next_token_penalized(logits, counts, key, np.float32(0.6), np.float32(0.0),
                                  0.0, 1.0)
  assert np.asarray(new).tolist() == [1, 1, 0, 3]

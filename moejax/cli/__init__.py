"""The user-facing programs, installed as console scripts (pyproject.toml):

  moejax-generate   generate.py   text from a model folder, resident or offloaded
  moejax-demo       demo.py       the offload presets side by side on the demo model
  moejax-emulate    emulate.py    policies x cache sizes, exact outputs (perplexity)
  moejax-trace      trace.py      record (or synthesise) a router trace
  moejax-simulate   simulate.py   replay a trace under policies and hardware profiles
  moejax-study      study.py      the substitution study (study_gen.py: its HumanEval part)
  moejax-frontier   frontier.py   the measured quality/speed frontier, auto-tuning

prepare/ holds the programs that make a model's files for generate's flags:
moejax-default-vectors and moejax-train-estimators (--prefetch=quasi, hybrid) and
moejax-host-ms (--host_ms).

app.py is their exit-code and Ctrl-C plumbing, stream.py writes text as it is
generated.  From a source checkout, launch/X.py runs the same program as a module.
"""

"""The command-line entry points and their configs:

- ``train.py``: ``lightning-mhc-train`` (Hydra; ``conf/`` holds the config groups, shipped in the
  package), checked by ``preflight.py`` before any process starts against ``schema.py``'s dataclasses;
- ``sweep.py``: the summary a multirun writes; ``run_dir.py``: one directory per run;
- ``export.py``: ``lightning-mhc-export``; ``generate.py``: ``lightning-mhc-generate``.
"""

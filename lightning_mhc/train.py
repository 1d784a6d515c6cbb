"""Kept for one release: ``python -m lightning_mhc.train`` runs ``lightning_mhc.cli.train``."""
from lightning_mhc.cli.train import *  # noqa: F401,F403
from lightning_mhc.cli.train import CONF_DIR, main  # noqa: F401

if __name__ == "__main__":
    main()

"""The LightningModules: ``MHCGPTModule`` (the mHC GPT of ``lightning_mhc.model``) and
``ParallelLMModule`` (a user's model through ``parallelize``)."""

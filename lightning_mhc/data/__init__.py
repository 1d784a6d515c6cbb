"""Training data: tokenizers (``tokenizers.py``), preprocessing text or JSONL into Megatron's
indexed format (``preprocess.py``), Megatron datasets and blends (``megatron.py``), byte-level
sources and their checks (``sources.py``), the one check that bytes are text (``text.py``), the
consumed-samples sampler (``samplers.py``), a loader that resumes mid-epoch
(``resumable_loader.py``) and the shipped sample corpus (``sample.py``)."""

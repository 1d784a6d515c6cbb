"""Training data: byte-level sources (a text file or folder, the Python standard library's
sources, random tokens) and their checks (``sources.py``), and a loader that resumes mid-epoch
(``resumable_loader.py``)."""

"""The dsv4_jax benchmark: break modes (none / narrow / wide) against each other and HF transformers.

Run it as ``python bench/run.py`` (see ``bench/run.py --help`` and ``bench/RESULTS.md``).
"""

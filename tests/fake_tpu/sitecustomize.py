"""Loaded at start-up by every Python process of a fake-TPU test (tests/fake_tpu is on its PYTHONPATH).

It does nothing unless XLA_MAGIC_FAKE_TPU is set; then fake_libtpu takes libtpu's place (its docstring says how).
"""

import os

if os.environ.get("XLA_MAGIC_FAKE_TPU"):
    import fake_libtpu

    fake_libtpu.install()

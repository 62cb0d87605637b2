"""Root of the test suite. Its presence puts ``tests/`` on ``sys.path`` (pytest's default import mode), so
every test module, in any subfolder, can ``import testdata`` (the committed cases and the tokenizer zoo)."""

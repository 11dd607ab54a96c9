"""The test suite, one folder per room of the code (tests/<room>/test_*.py); shared fixtures in conftest.py."""

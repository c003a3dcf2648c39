import pytest


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_path):
    return smollm2_path

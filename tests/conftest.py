import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def pytest_collection_finish(session):
    """The collected tests and the modules they imported stay for the whole run: frozen out of the
    garbage collector's scans, so a full collection (Megatron runs them around every checkpoint save
    and load) scans only what the tests create (0.26 s per scan after torch and Megatron otherwise)."""
    import gc

    gc.collect()
    gc.freeze()

"""The core's tests, mirroring relax_core's packages; ``tests.support`` holds shared helpers."""

"""What every benchmark prints first: the platform it ran on, then its table header."""

import jax


def print_header(header: str) -> None:
    print(f"backend={jax.default_backend()} devices={jax.device_count()} jax={jax.__version__}")
    print(header)
    print("-" * len(header))

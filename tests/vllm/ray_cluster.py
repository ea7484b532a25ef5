"""A local Ray cluster for the tests, in a process of its own: ``python ray_cluster.py NUM_CPUS
TEMP_DIR`` starts one, prints ``address HOST:PORT`` and keeps it up until its standard input
closes, then shuts it down.

Its environment (``ray_env``) keeps it on the loopback address (Ray otherwise advertises the
machine's network address; on Linux it does so unless told this is a one-machine cluster) and
gives it a token of its own (Ray would otherwise write one into ~/.ray); the tests' clients use
the same environment."""

from __future__ import annotations

import secrets
import sys


def ray_env() -> dict[str, str]:
    """Environment variables for the cluster and its clients."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node address 127.0.0.1
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def main() -> int:
    import ray

    num_cpus, temp_dir = int(sys.argv[1]), sys.argv[2]
    ctx = ray.init(
        num_cpus=num_cpus,
        num_gpus=0,
        include_dashboard=False,
        _temp_dir=temp_dir,
        object_store_memory=80 << 20,
        logging_level="WARNING",
        log_to_driver=False,
    )
    print("address", ctx.address_info["gcs_address"], flush=True)
    try:
        sys.stdin.read()  # until the test closes it (or dies)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The data plane's rendezvous store in a process of its own.

The master is an MPI process; a torch ``TCPStore`` server inside it reset its clients'
connections and later crashed the process (MPICH 5.0.2 + torch 2.13 CPU, seen under
``srun --mpi=pmi2``). So the master starts this small child, which owns the store
(:class:`pearl_hpc.comm.dataplane.Rendezvous`) and exits with its parent.

    python -m pearl_hpc.comm.store_server PORT_FILE [HOST]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


class StoreProcess:
    """Start the store server child; ``.host`` and ``.port`` once it listens."""

    def __init__(self, run_dir: Path, host: str, *, timeout_s: float = 60.0) -> None:
        port_file = run_dir / "store-port"
        port_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI"))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pearl_hpc.comm.store_server", str(port_file), host], env=env
        )
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the rendezvous store did not start (see {run_dir})")
            time.sleep(0.05)
        self.host = host
        self.port = int(port_file.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main(argv: list[str]) -> int:
    from pearl_hpc.comm.dataplane import Rendezvous

    port_file = Path(argv[0])
    host = argv[1] if len(argv) > 1 else ""
    parent = os.getppid()
    store = Rendezvous(host=host)
    tmp = port_file.with_name(f".{port_file.name}")
    tmp.write_text(str(store.port))
    tmp.replace(port_file)
    while os.getppid() == parent:  # exit with the master
        time.sleep(0.5)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

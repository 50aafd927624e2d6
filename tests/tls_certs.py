"""Self-signed TLS certificates made at test time (nothing is downloaded or checked in).

The certificate is the one a deployed worker makes for itself
(``remotorch.deploy.container.self_signed``); here it is written to files.
"""

from __future__ import annotations

from pathlib import Path

from remotorch.deploy.container import self_signed as make_certificate


def self_signed(directory: Path, name: str, host: str = "127.0.0.1") -> tuple[str, str]:
    """Write ``name``.crt and ``name``.key (a certificate for ``host``, its own CA); returns their paths."""
    cert_pem, key_pem = make_certificate(host, days=1)
    crt_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    crt_path.write_bytes(cert_pem)
    key_path.write_bytes(key_pem)
    return str(crt_path), str(key_path)

"""The checked-in generated gRPC code must match proto/ (regenerate: python -m ecrec.protogen)."""

import pytest

from ecrec import protogen


def test_generated_code_is_current():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the code")
    stale = protogen.stale_files()
    assert stale == [], f"stale generated files {stale}: run python -m ecrec.protogen"

"""The checked-in stubs match the .proto files, and the API keeps its contract names."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from tandem.protos import generate
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

CHECKED_IN = generate.PROTO_DIR


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> list[Path]:
    return generate.generate(tmp_path_factory.mktemp("stubs"))


def test_every_proto_has_its_stubs(regenerated):
    names = sorted(p.name for p in regenerated)
    assert names == sorted(p.name for p in CHECKED_IN.iterdir() if "_pb2" in p.name), names
    assert len(names) == 3 * len(generate.proto_files())


def test_stubs_do_not_drift(regenerated):
    for fresh in regenerated:
        checked_in = CHECKED_IN / fresh.name
        # A different grpcio-tools formats the same descriptors differently; the descriptors are
        # compared below whatever the version, the bytes only when it matches the stamp.
        if f"(grpcio-tools {metadata.version('grpcio-tools')})" not in checked_in.read_text():
            continue
        assert fresh.read_bytes() == checked_in.read_bytes(), (
            f"{checked_in.name} is stale: run `python protos/generate.py` and commit the result")


@pytest.mark.parametrize("module", [generation_pb2, admin_pb2])
def test_descriptors_match_the_protos(module, regenerated, tmp_path):
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    proto = CHECKED_IN / Path(module.DESCRIPTOR.name).name
    args = ["protoc", f"-I{generate.REPO_ROOT}", f"--descriptor_set_out={out}", str(proto)]
    assert protoc.main(args) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc adds json_name; Python stubs leave it out
        _clear_json_names(message)
    loaded = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(loaded)
    assert fresh == loaded, f"{proto.name} changed: run `python protos/generate.py`"


def _clear_json_names(message) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)


def test_service_names_are_the_contract():
    assert generation_pb2.DESCRIPTOR.package == "tandem.v1"
    generation = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert generation.full_name == "tandem.v1.Generation"
    assert admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name == "tandem.v1.Admin"
    methods = generation.methods_by_name
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name) == {
        "GetClusterState", "SetPoolBounds", "DrainWorker", "SetWorkerRole", "MoveSequences"}
    assert hasattr(generation_pb2_grpc, "GenerationStub") and hasattr(admin_pb2_grpc, "AdminStub")


def test_contract_field_names():
    fields = lambda msg: set(msg.DESCRIPTOR.fields_by_name)  # noqa: E731
    assert {"request_id", "session_id", "prompt", "prompt_token_ids", "messages",
            "sampling"} <= fields(generation_pb2.GenerateRequest)
    assert {"role", "content"} <= fields(generation_pb2.ChatMessage)
    assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "ignore_eos"} <= fields(generation_pb2.SamplingParams)
    assert {"token_ids", "text", "finish_reason", "usage"} <= fields(
        generation_pb2.GenerateResponse)
    assert {"prompt_tokens", "cached_prompt_tokens", "completion_tokens", "draft_tokens",
            "accepted_draft_tokens"} <= fields(generation_pb2.Usage)
    assert [v.name for v in generation_pb2.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "STOP", "LENGTH", "ABORT"]


def test_unset_is_distinguishable_from_zero():
    sampling = generation_pb2.SamplingParams(max_tokens=0, top_p=0.0)
    assert sampling.HasField("max_tokens") and sampling.HasField("top_p")
    assert not sampling.HasField("seed")
    assert generation_pb2.GenerateRequest(prompt="").HasField("prompt")
    assert not generation_pb2.GenerateRequest().HasField("prompt")
    assert admin_pb2.SetPoolBoundsRequest(target=0).HasField("target")


def test_version_pins_are_relaxed():
    # Stubs must load on every runtime pyproject.toml allows, not only on the generator's.
    for stub in CHECKED_IN.glob("*_pb2.py"):
        assert "ValidateProtobufRuntimeVersion" not in stub.read_text(), stub.name
    assert generation_pb2_grpc.GRPC_GENERATED_VERSION == generate.GRPC_FLOOR
    assert admin_pb2_grpc.GRPC_GENERATED_VERSION == generate.GRPC_FLOOR

"""Score candidate prefill workers for one prompt with kvloopd's Route: for a router outside kvloop.

Route ranks the candidates by expected time to first token: each one's own prefix cache, the reverse
pull kvloop would add on top of it, what is left to compute and its queue. It is read-only. Give the
prompt as token ids (kvloopd hashes them as the model's vLLM engines do) and each candidate as a
registered worker id or HTTP endpoint, with the requests you have in flight on it:

    python examples/score_candidates.py --daemon 127.0.0.1:50051 --model my-model \\
        --token-ids 1,2,3,... --candidate prefill-0=2 --candidate http://10.0.0.7:8000

It prints the ranking as JSON (best first). Only grpcio and the generated kvloop.v1 stubs are needed
(`pip install kvloop`, or generate them from proto/kvloop/v1/directory.proto).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc


def candidate(text: str) -> pb.RouteCandidate:
    """NAME[=IN_FLIGHT]: a worker id, or an http(s) URL naming a worker by its registered endpoint."""
    name, _, in_flight = text.partition("=")
    key = "http_endpoint" if name.startswith(("http://", "https://")) else "worker_id"
    return pb.RouteCandidate(**{key: name}, in_flight_requests=int(in_flight or 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemon", default="127.0.0.1:50051", help="kvloopd HOST:PORT")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--token-ids", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--cache-salt", default="", help="the request's vLLM cache_salt, if any")
    parser.add_argument("--candidate", action="append", required=True, help="NAME[=IN_FLIGHT], repeatable")
    parser.add_argument("--timeout", type=float, default=0.5, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    request = pb.RouteRequest(
        model=args.model,
        token_ids=[int(t) for t in args.token_ids.split(",") if t.strip()],
        cache_salt=args.cache_salt,
        candidates=[candidate(c) for c in args.candidate],
    )
    with grpc.insecure_channel(args.daemon) as channel:
        try:
            answer = pb_grpc.DirectoryStub(channel).Route(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            # A router would fall back to its own rule here.
            print(f"Route failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(answer, preserving_proto_field_name=True), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

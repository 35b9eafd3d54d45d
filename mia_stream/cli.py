"""``mia-stream``: one console script, one subcommand per component. Each subcommand's module parses its own args."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). Modules load lazily so `mia-stream broker` never imports torch.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("mia_stream.demo", "main", "run the end-to-end demo on the embedded model"),
    "model": ("mia_stream.model", "main", "build (once) the embedded default model and print its path"),
    "broker": ("mia_stream.broker", "main", "run the broker between producers and consumers"),
    "stats": ("mia_stream.broker", "stats_main", "print a running broker's statistics"),
    "keys": ("mia_stream.bus.transport", "keys_main", "create CURVE key pairs for tcp endpoints"),
    "consume": ("mia_stream.consumers", "consume_main", "run a Consumer class (MODULE:Class) as a process"),
    "serve": ("mia_stream.served.serve", "main", "serve a model over HTTP (vLLM's OpenAI server) with broker and plugin"),
    "record": ("mia_stream.consumers.recorder", "main", "record streams from a broker into MCAP files"),
    "replay": ("mia_stream.consumers.replay", "main", "replay a recording into consumers or a broker"),
    "vectors": ("mia_stream.spec.vectors", "main", "register named steering vectors"),
    "probes": ("mia_stream.spec.probes", "main", "register detector probes for in-engine detectors"),
    "analyze": ("mia_stream.analyzers", "analyze_main", "run an analyzer on live or recorded streams (--list)"),
    "monitor": ("mia_stream.monitor", "main", "watch a broker's requests or a recording: a web page, or --terminal"),
    "bridge": ("mia_stream.bridge", "main", "publish a broker's streams to NATS JetStream; steering back (docs/nats.md)"),
    "top": ("mia_stream.metrics.top", "main", "a live table of every process's metrics (MIA_STREAM_METRICS_PORT)"),
    "probe": ("mia_stream.lab.probe_cli", "main", "collect data, train and evaluate hallucination probes"),
    "heads": ("mia_stream.lab.head_discovery", "main", "choose an attention analyzer's heads and write its config"),
}


def _usage() -> str:
    lines = ["usage: mia-stream COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "`mia-stream COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"mia-stream: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

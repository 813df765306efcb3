"""The `murmur` command line: argument parsing, validation and dispatch to the commands
(node, join, bootstrap, status, eval, invite, topology, sim, demo, export, tokenizer).

Bad flags and values exit with status 2 and one line saying what is wrong. Heavy imports (torch,
hivemind) happen inside the commands that need them, so `murmur topology` and `--help` stay quick.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gossip.mixing import MIXING_KINDS
from node.config import (
    DAEMONS,
    EMBEDDED_MODEL_NAMES,
    ENV_CONFIG_FILE,
    HF_PRESET_NAMES,
    NODE,
    NODE_CODECS,
    OPTIMIZERS,
    SETTINGS_BY_KEY,
    STATE_CODECS,
    Boolean,
    Choice,
    Command,
    ConfigError,
    EdgeList,
    Model,
    Multiaddrs,
    NodeConfig,
    ResolvedConfig,
    Setting,
    check_environment,
    default_in_words,
    merge_layers,
    read_config_file,
    read_environment,
    read_flags,
    settings_for,
)
from node.config.settings import MONITOR_TOKEN_FILE
from topology import TOPOLOGY_NAMES, WEIGHT_SCHEMES, TopologySpec, build_topology


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A value that parsed but makes no sense together with the others; the CLI exits with status 2."""


class _ConfigErrorParser(OneLineErrorParser):
    """The same parser for `parse_node_config`: a usage error raises ConfigError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _number(
    kind: type[int] | type[float], lo: float | None = None, hi: float | None = None, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: `kind` parsed from text, at least `lo` and at most (or below) `hi`."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"{text} is below the minimum {lo}")
        if hi is not None and (value >= hi if hi_open else value > hi):
            raise argparse.ArgumentTypeError(f"{text} must be {'below' if hi_open else 'at most'} {hi}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = _number(int, lo=1)
non_negative_int = _number(int, lo=0)
probability = _number(float, lo=0.0, hi=1.0, hi_open=True)
non_negative_float = _number(float, lo=0.0)


def _edge_list(text: str) -> tuple[tuple[int, int], ...]:
    """'0-1,1-2,2-0' -> ((0, 1), (1, 2), (2, 0)), parsed as the config file and environment parse it."""
    try:
        edges = EdgeList().from_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not edges:
        raise argparse.ArgumentTypeError(f"{text!r} is not an edge list like 0-1,1-2,2-0")
    return edges


def _add_topology_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_SCHEMES, help="mixing-weight scheme (default: the family's own)")
    p.add_argument("--degree", type=positive_int, default=4, help="degree of random-regular (default 4)")
    p.add_argument("--topology-seed", type=non_negative_int, default=0, help="seed of random-regular (default 0)")
    p.add_argument("--rows", type=positive_int, help="rows of the torus (default: the most square shape)")
    p.add_argument("--edges", type=_edge_list, help="edge list of the custom topology over ranks, e.g. 0-1,1-2,2-0")


def build_parser(parser_class: type[argparse.ArgumentParser] = OneLineErrorParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="murmur",
        description="murmur: peer-to-peer decentralized training. Nodes find each other through a DHT "
        "and mix parameters with their neighbours by gossip.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    topo = commands.add_parser(Command.TOPOLOGY, help="describe a topology: degree, rho, spectral gap",
                               description="Describe a gossip topology over N peers: degree, rho = "
                               "||W - 11^T/n||_2 (per-round rate for time-varying schedules) and spectral gap.")
    topo.add_argument("name", choices=TOPOLOGY_NAMES, help="topology family")
    topo.add_argument("--peers", type=positive_int, required=True, help="number of peers N")
    topo.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_topology_options(topo)
    topo.set_defaults(run=_run_topology)

    sim = commands.add_parser(Command.SIM, help="simulate gossip over a topology in one process",
                              description="Simulate N peers gossiping random vectors over a topology, with "
                              "message loss, churn and a link model; print consensus error and bytes per round.")
    sim.add_argument("--peers", type=positive_int, required=True, help="number of peers N")
    sim.add_argument("--topology", choices=TOPOLOGY_NAMES, default="one-peer-exp", help="topology family (default one-peer-exp)")
    sim.add_argument("--rounds", type=non_negative_int, default=20, help="gossip rounds (default 20)")
    sim.add_argument("--drop", type=probability, default=0.0, help="probability a message is lost (default 0)")
    sim.add_argument("--churn", type=probability, default=0.0,
                     help="per-round probability that a peer leaves; as many new peers join (default 0)")
    sim.add_argument("--dim", type=positive_int, default=1000, help="parameters per peer (default 1000)")
    sim.add_argument("--codec", choices=STATE_CODECS, default="fp32", help="wire codec (default fp32)")
    sim.add_argument("--mixing", choices=MIXING_KINDS, default="weighted",
                     help="mixing rule (default weighted)")
    sim.add_argument("--tau", type=_number(float, lo=1e-12), help="clipping radius for --mixing clipped")
    sim.add_argument("--trim", type=_number(float, lo=0.0, hi=0.5, hi_open=True), default=0.2,
                     help="fraction trimmed per side for --mixing trimmed_mean (default 0.2)")
    sim.add_argument("--latency-ms", type=non_negative_float, default=0.0, help="one-way link latency (default 0)")
    sim.add_argument("--bandwidth-mbit", type=_number(float, lo=1e-6), help="link bandwidth in Mbit/s (default unlimited)")
    sim.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    sim.add_argument("--json", action="store_true", help='print {"rounds": [{"round", "consensus_error", "bytes", ...}]}')
    _add_topology_options(sim)
    sim.set_defaults(run=_run_sim)
    _add_node_commands(commands)
    _add_invite_command(commands)
    _add_demo_command(commands)
    _add_plan_command(commands)
    _add_hf_commands(commands)
    return parser


# diloco's inner steps per outer sync when --local-steps is not given (DiLoCo's own range is 100-500)
PLAN_DILOCO_LOCAL_STEPS = 100


def _add_plan_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        Command.PLAN, help="predict per-step time and bytes of a configuration against ring all-reduce",
        description="Predict, for a model, a link and a swarm, the time per step and the bytes per step and per "
        "token of gossip training as murmur runs it, next to ring all-reduce with the same codec and sync period "
        "and to data-parallel fp32 all-reduce every step, and say which wins and by how much (docs/plan.md). "
        "Bytes are the exact message sizes of the wire format; times are a model checked against "
        "bench/bench_wan.py. Without --step-time it measures a step of the model on this machine.")
    size = plan.add_mutually_exclusive_group()
    size.add_argument("--model", default=Model.MOE, metavar="MODEL",
                      help="model whose parameters are counted: moe, dense or package.module:callable (default moe)")
    size.add_argument("--params", type=positive_int, help="parameter count instead of a model (needs --step-time)")
    plan.add_argument("--step-time", type=_number(float, lo=0.0), metavar="SECONDS",
                      help="compute time of one step on one node (default: measured on this machine)")
    plan.add_argument("--measure-steps", type=_number(int, lo=1, hi=100), default=3,
                      help="steps timed when measuring the step time, after one warm-up (default 3)")
    plan.add_argument("--round-cpu", type=_round_cpu, metavar="SECONDS|measure",
                      help="CPU seconds of one sync's local work on a node (encoding, decoding, mixing), or 'measure' "
                      "to time it here (default: measured when the step time is, else 0)")
    plan.add_argument("--threads", type=non_negative_int, default=1,
                      help="torch threads when measuring; 0: torch's default (default 1, as murmur demo runs nodes)")
    plan.add_argument("--bandwidth-mbit", type=_number(float, lo=1e-6), default=20.0,
                      help="each node's link rate in Mbit/s, each way (default 20)")
    plan.add_argument("--latency-ms", type=non_negative_float, default=25.0, help="one-way latency (default 25)")
    plan.add_argument("--link-efficiency", type=_number(float, lo=1e-3, hi=1.0), default=None,
                      help="share of the link rate that carries message bytes (default 0.93, measured)")
    plan.add_argument("--peers", type=_number(int, lo=2), default=8, help="number of peers (default 8)")
    plan.add_argument("--topology", choices=TOPOLOGY_NAMES, default="one-peer-exp",
                      help="gossip topology (default one-peer-exp)")
    plan.add_argument("--optimizer", choices=("dsgd", "dadam", "diloco"), default="dadam",
                      help="dsgd, dadam (round overlapped with the step) or diloco (default dadam)")
    plan.add_argument("--local-steps", type=positive_int,
                      help=f"H: steps between syncs (default 1; {PLAN_DILOCO_LOCAL_STEPS} for diloco)")
    plan.add_argument("--fragments", type=positive_int, default=1,
                      help="P: diloco's streaming fragments, each synced once per H steps (default 1)")
    plan.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                      help="diloco: the outer sync runs while the next phase computes (default off, as a node's)")
    plan.add_argument("--outer-lr", type=_number(float, lo=1e-9, hi=10.0), default=0.7,
                      help="diloco: outer learning rate (default 0.7; with 1, momentum 0 and --anchor-codec equal to "
                      "--codec a sync that mixes anchors sends one message instead of two)")
    plan.add_argument("--outer-momentum", type=_number(float, lo=0.0, hi=0.999999), default=0.9,
                      help="diloco: outer Nesterov momentum (default 0.9)")
    plan.add_argument("--anchor-every", type=non_negative_int, default=1,
                      help="diloco: the anchors are mixed too at every this-many-th sync, a second round; 0: never "
                      "(default 1)")
    plan.add_argument("--anchor-codec", choices=STATE_CODECS, default="int8",
                      help="diloco: codec of the anchors (default int8)")
    plan.add_argument("--codec", choices=NODE_CODECS, default="fp32", help="wire codec (default fp32)")
    plan.add_argument("--topk-ratio", type=_number(float, lo=1e-9, hi=1.0), default=0.01,
                      help="share of the elements --codec topk sends (default 0.01)")
    plan.add_argument("--topk-packed", action="store_true",
                      help="--codec topk in the packed layout: 3 bytes per kept element instead of 8")
    plan.add_argument("--topk-elias-fano", action="store_true",
                      help="--codec topk packed with Elias-Fano indices: about 2 bytes per kept element at 1-2%%")
    plan.add_argument("--gossip-compression", choices=("none", "choco"), default="none",
                      help="choco: dsgd/dadam send compressed differences against per-neighbour estimates")
    plan.add_argument("--batch-size", type=positive_int, default=16, help="sequences per micro-batch (default 16)")
    plan.add_argument("--context", type=_number(int, lo=2), default=128, help="tokens per sequence (default 128)")
    plan.add_argument("--micro-batches", type=positive_int, default=1, help="micro-batches per step (default 1)")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object: inputs, numel, gossip, allreduce, data_parallel (each: step_s, "
                      "sync_s, syncs_per_step, sent_bytes_per_step, received_bytes_per_step, bytes_per_token, ...), "
                      "winner, speedup, bytes_ratio, vs_data_parallel")
    _add_topology_options(plan)
    plan.set_defaults(run=_run_plan)


def _round_cpu(text: str) -> float | str:
    """--round-cpu: seconds, or 'measure'."""
    return text if text == "measure" else _number(float, lo=0.0)(text)


def _run_plan(args: argparse.Namespace) -> int:
    from gossip.choco import check_topology
    from gossip.codecs import TopKCodec, get_codec
    from gossip.plan import DEFAULT_LINK_EFFICIENCY, Algorithm, Compression, LinkSpec, PlanConfig
    from node.cli.plan import Measure, StepTime, flat_specs, measure_costs, model_specs, plan_and_print

    algorithm, compression = Algorithm(args.optimizer), Compression(args.gossip_compression)
    if args.params is not None and args.step_time is None:
        raise UsageError("--params gives no model to measure a step of: pass --step-time SECONDS too")
    # the combinations PlanConfig refuses, checked before a model is built (that imports torch)
    if args.fragments > 1 and algorithm is not Algorithm.DILOCO:
        raise UsageError("--fragments: streaming fragments are diloco's outer sync; use them with --optimizer diloco")
    if compression is Compression.CHOCO and algorithm is Algorithm.DILOCO:
        raise UsageError("--gossip-compression choco is for the per-step algorithms dsgd and dadam; diloco "
                         "compresses its pseudo-gradients with --codec")
    if args.codec == "topk" and algorithm is not Algorithm.DILOCO and compression is not Compression.CHOCO:
        raise UsageError("--codec topk drops most of every message; it is sound on differences only: use it with "
                         "--gossip-compression choco or --optimizer diloco")
    topology = _topology_spec(args, args.topology)
    with _values_checked():
        if compression is Compression.CHOCO:
            check_topology(topology)
        codec = (TopKCodec(args.topk_ratio, args.topk_packed or args.topk_elias_fano, args.topk_elias_fano)
                 if args.codec == "topk" else get_codec(args.codec))
        link = LinkSpec(args.bandwidth_mbit, args.latency_ms,
                        DEFAULT_LINK_EFFICIENCY if args.link_efficiency is None else args.link_efficiency)
        build_topology(topology, args.peers)  # a bad combination fails here, in one line
    if args.params is not None:
        specs, model = tuple(flat_specs(args.params)), f"{args.params:,} parameters"
    else:
        try:
            specs, model = model_specs(args.model), args.model
        except (ValueError, ImportError, AttributeError, TypeError) as exc:
            raise UsageError(f"--model {args.model}: {exc}") from None
    local_steps = args.local_steps or (PLAN_DILOCO_LOCAL_STEPS if algorithm is Algorithm.DILOCO else 1)
    with _values_checked():
        config = PlanConfig(specs, 0.0 if args.step_time is None else args.step_time, link, args.peers, topology,
                            algorithm=algorithm, codec=codec, local_steps=local_steps, fragments=args.fragments,
                            compression=compression, overlap=args.overlap, outer_lr=args.outer_lr,
                            outer_momentum=args.outer_momentum, anchor_every=args.anchor_every,
                            anchor_codec=get_codec(args.anchor_codec),
                            tokens_per_step=args.batch_size * args.context * args.micro_batches)
    # a step time given from elsewhere (say a GPU) says nothing of this machine's CPU: then 0 unless asked
    measure_cpu = args.round_cpu == "measure" or (args.round_cpu is None and args.step_time is None)
    costs = measure_costs(Measure(None if args.step_time is not None else args.model, args.measure_steps,
                                  args.batch_size, args.context, args.micro_batches, args.optimizer, args.threads,
                                  round_repeats=args.measure_steps if measure_cpu else 0),
                          specs, codec, compression, build_topology(topology, args.peers))
    step = costs.step if costs.step is not None else StepTime(args.step_time, "given")
    round_cpu = args.round_cpu if isinstance(args.round_cpu, float) else costs.round_cpu_s or 0.0
    config = dataclasses.replace(config, step_time_s=step.seconds, round_cpu_s=round_cpu)
    plan_and_print(config, step, model, as_json=args.json)
    return 0


def _add_invite_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    invite = commands.add_parser(
        Command.INVITE, help="admit a peer to an allowlist swarm: issue its membership certificate (founder)",
        epilog=_PRECEDENCE,
        description="Issue the membership certificate of PEER_ID in the swarm, signed with the founder's identity "
        "key: run it where the founder's node runs (its --data-dir or --identity; the running node may keep "
        "running). The peer joins with `murmur join --invite SWARM@FOUNDER --certificate FILE`. Only an allowlist "
        "swarm (`murmur node --admission allowlist`) asks for certificates.")
    _add_config_flag(invite)
    invite.add_argument("peer_id", metavar="PEER_ID", help="peer id of the node to admit (its `murmur status` shows it)")
    for setting in settings_for(Command.INVITE):
        _add_setting_flag(invite, setting)
    invite.add_argument("--valid-days", type=_number(float, lo=0.001, hi=36500), default=365.0, metavar="DAYS",
                        help="days until the certificate expires (default 365)")
    invite.add_argument("--out", type=Path, metavar="FILE", help="write the certificate to FILE instead of stdout")
    invite.set_defaults(run=_run_invite)


def _run_invite(args: argparse.Namespace) -> int:
    import time

    from node.net.founder import check_peer_id, issue_certificate
    from node.net.identity import IdentityError, load_identity

    config = _resolve(args, os.environ).config
    try:
        peer_id = check_peer_id(args.peer_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not config.identity_path.exists():
        raise UsageError(f"no founder identity at {config.identity_path}: run `murmur invite` with the founder "
                         "node's --data-dir or --identity")
    try:
        identity = load_identity(config.identity_path)
    except IdentityError as exc:
        raise UsageError(str(exc)) from None
    certificate = issue_certificate(identity.signing_key, config.swarm, peer_id,
                                    int(time.time() + args.valid_days * 86400))
    if args.out is None:
        sys.stdout.write(certificate.text)
    else:
        try:
            args.out.write_text(certificate.text)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: {exc.strerror}") from None
    print(f"murmur invite: {peer_id} may join swarm {config.swarm!r} until "
          f"{time.strftime('%Y-%m-%d', time.gmtime(certificate.expires))} with `murmur join --invite "
          f"{config.swarm}@{identity.peer_id} --certificate FILE`", file=sys.stderr)
    return 0

def _add_hf_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = commands.add_parser(
        Command.EXPORT, help="write the swarm's model as a directory transformers (or safetensors) loads",
        description="Write a swarm's model to --to DIR: for a Hugging Face model a save_pretrained directory "
        "(config, model.safetensors, the swarm's tokenizer) that AutoModelForCausalLM and AutoTokenizer load; for "
        "the embedded models model.safetensors with one tensor per parameter and config.json (docs/training.md, "
        "\"Export\"). From a node's --data-dir (its swarm average if written, else its checkpoint; --from picks), or "
        "from a running node's monitor (--url), which first pulls and writes the swarm average.")
    export.add_argument("--to", type=Path, required=True, metavar="DIR", help="the directory to write (must not exist, "
                        "or be empty, unless --force)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", type=Path, metavar="DIR", help="a node's data directory")
    source.add_argument("--url", help="monitor URL of a running node on this machine, e.g. http://127.0.0.1:7690")
    export.add_argument("--from", dest="source", choices=("average", "checkpoint"),
                        help="with --data-dir: the swarm average (swarm-average.safetensors) or this node's own "
                        "checkpoint (default: the average if there is one)")
    export.add_argument("--force", action="store_true", help="replace --to if it exists")
    export.add_argument("--timeout", type=_number(float, lo=1.0), default=300.0, metavar="SECONDS",
                        help="with --url: how long to wait for the node's swarm average (default 300)")
    export.add_argument("--token", help="with --url: the node's monitor token (default: read from "
                        "./murmur-data/monitor.token for a loopback URL; its POST endpoints need it)")
    export.set_defaults(run=_run_export)

    tokenizer = commands.add_parser(
        Command.TOKENIZER, help="train a byte-level BPE tokenizer on local data",
        description="Tokenizer tools. `murmur tokenizer train --data PATH --vocab N` trains a byte-level BPE with "
        "the tokenizers library on local text, jsonl or parquet shards (no download) and writes a tokenizer.json "
        "for --tokenizer.")
    actions = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train a byte-level BPE on local files",
                               description="Train a byte-level BPE (EOS <|endoftext|> at id 0, the 256 bytes, then "
                               "merges) on the training units of --data (the validation units are left out) and "
                               "write it as a tokenizer.json.")
    train.add_argument("--data", type=Path, required=True, metavar="PATH",
                       help="a directory, file or glob of .txt, .jsonl or .parquet shards")
    train.add_argument("--vocab", type=_number(int, lo=257, hi=1 << 21), required=True, metavar="N",
                       help="vocabulary size, at least 257 (EOS and the 256 bytes)")
    train.add_argument("--text-field", default="text", metavar="FIELD",
                       help="the jsonl field or parquet column with the text (default text)")
    train.add_argument("--out", type=Path, default=Path("tokenizer.json"), metavar="FILE",
                       help="where to write the tokenizer (default ./tokenizer.json)")
    train.set_defaults(run=_run_tokenizer_train)


def _run_export(args: argparse.Namespace) -> int:
    from node.cli.export import ExportUsage, run_export

    if args.source is not None and args.url is not None:
        raise UsageError("--from applies to --data-dir; with --url the node writes and exports its swarm average")
    if args.token is not None and args.url is None:
        raise UsageError("--token applies to --url")
    token = None
    if args.url is not None:
        token = args.token.strip() if args.token is not None else _loopback_token(args.url, NodeConfig().data_dir)
    try:
        return run_export(args.to, args.data_dir, args.url, args.source, args.force, args.timeout, token=token)
    except ExportUsage as exc:
        raise UsageError(str(exc)) from None


def _run_tokenizer_train(args: argparse.Namespace) -> int:
    from node.cli.tokenizer import TokenizerUsage, run_tokenizer_train

    try:
        return run_tokenizer_train(args.data, args.vocab, args.out, args.text_field)
    except TokenizerUsage as exc:
        raise UsageError(str(exc)) from None


def _add_demo_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        Command.DEMO, help="train the embedded model with a local swarm of node processes",
        description="Start N node processes on loopback in one swarm training the embedded model (MoE by "
        "default), print the first node's monitor URL and the progress, stop them when every node has "
        "taken --steps steps, and print the validation loss of each node and of the averaged model next "
        "to that of the untrained model. Node logs and checkpoints live in a temporary directory (--dir "
        "keeps them).")
    demo.add_argument("--nodes", type=_number(int, lo=1, hi=32), default=4, help="node processes (default 4)")
    demo.add_argument("--steps", type=_number(int, lo=1), default=100, help="training steps per node (default 100)")
    demo.add_argument("--topology", choices=TOPOLOGY_NAMES, default="one-peer-exp",
                      help="gossip topology (default one-peer-exp)")
    demo.add_argument("--optimizer", choices=OPTIMIZERS, default="dadam", help="optimizer (default dadam)")
    demo.add_argument("--model", choices=(*EMBEDDED_MODEL_NAMES, *HF_PRESET_NAMES), default=Model.MOE,
                      help="embedded model, or a tiny Hugging Face preset built with transformers (default moe)")
    demo.add_argument("--lr", type=_number(float, lo=1e-12), help="peak learning rate (default: the node's, 3e-3)")
    demo.add_argument("--batch-size", type=_number(int, lo=1), default=16,
                      help="sequences per step on each node (default 16)")
    demo.add_argument("--spes", action="store_true",
                      help="sparse expert sync of the experts (SPES): --model moe or hf-tiny-mixtral")
    recipe = demo.add_argument_group("the swarm's recipe, as `murmur node` takes it (--optimizer diloco's knobs and "
                                     "the codec); default: the node's, --local-steps 20 with diloco")
    for key in DEMO_RECIPE_KEYS:
        _add_setting_flag(recipe, SETTINGS_BY_KEY[key])
    demo.add_argument("--dir", type=Path, help="keep node logs and checkpoints in this directory")
    demo.add_argument("--json", action="store_true",
                      help="end with one JSON object: initial_val_loss, averaged_val_loss, nodes (peer_id, "
                      "val_loss, steps, bytes_sent, bytes_received, trainable_params, optimizer_state_bytes) and "
                      "traffic (bytes_per_node_per_step, default_demo_bytes_per_node_per_step, ratio_to_default)")
    demo.set_defaults(run=_run_demo)


# recipe settings `murmur demo` passes through to its founder
DEMO_RECIPE_KEYS = ("gossip.codec", "gossip.topk_ratio", "gossip.topk_packed", "gossip.topk_elias_fano",
                    "training.local_steps", "training.fragments", "training.overlap", "training.outer_lr", "training.outer_momentum",
                    "training.qsr_alpha", "training.anchor_every", "training.anchor_codec",
                    "training.inner_optimizer", "training.final_merge")


def _run_demo(args: argparse.Namespace) -> int:
    if args.spes and args.model not in (Model.MOE, "hf-tiny-mixtral"):
        raise UsageError(f"--spes: SPES syncs the experts of an MoE model (moe, hf-tiny-mixtral); --model {args.model} has none")
    from node.cli.demo import DEMO_DILOCO_LOCAL_STEPS, DemoOptions, run_demo

    given = {SETTINGS_BY_KEY[key]: vars(args)[SETTINGS_BY_KEY[key].dest] for key in DEMO_RECIPE_KEYS
             if SETTINGS_BY_KEY[key].dest in vars(args)}
    local_steps = SETTINGS_BY_KEY["training.local_steps"]
    if args.optimizer == "diloco" and local_steps not in given:
        given[local_steps] = str(DEMO_DILOCO_LOCAL_STEPS)
    # the founder's own checks, so a bad combination exits 2 here rather than in a node
    merge_layers(read_flags({**given, SETTINGS_BY_KEY["training.optimizer"]: args.optimizer,
                             SETTINGS_BY_KEY["training.spes"]: args.spes,
                             SETTINGS_BY_KEY["training.model"]: str(args.model)}))
    flags: list[str] = []
    for setting, value in given.items():
        if isinstance(value, bool):
            flags.append(setting.flag if value else f"--no-{setting.flag[2:]}")
        else:
            flags += [setting.flag, str(value)]
    return run_demo(DemoOptions(nodes=args.nodes, steps=args.steps, topology=args.topology, optimizer=args.optimizer,
                                model=args.model, lr=args.lr, batch_size=args.batch_size, as_json=args.json,
                                workdir=args.dir.absolute() if args.dir else None, spes=args.spes,
                                recipe_flags=tuple(flags)))


_PRECEDENCE = (
    "Each setting comes from, in increasing precedence: its default, the --config file (TOML), its "
    "MURMUR_* environment variable, its flag. A bad flag or value exits with status 2 and one line. "
    "All settings: docs/cli.md."
)

# Help sections of the node commands, by the first part of a setting's key.
_SECTIONS = {"network": "network", "monitor": "monitor page", "gossip": "gossip", "training": "training"}


def _add_node_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    node = commands.add_parser(
        Command.NODE, help="found a new swarm and run a node in it", epilog=_PRECEDENCE,
        description="Found a new swarm and run a node in it: join the DHT (through --peers if given, e.g. a "
        "bootstrap node), publish the swarm's config, gossip parameters with topology neighbours and serve "
        "the monitor page. SIGINT/SIGTERM stop it cleanly; restarting with the same identity and data dir resumes.",
    )
    join = commands.add_parser(
        Command.JOIN, help="join an existing swarm through one of its peers", epilog=_PRECEDENCE,
        description="Join an existing swarm: read its config from the DHT through --peers (at least one, from "
        "the flag, MURMUR_PEERS or the config file), fetch the latest parameters from a live peer, then train "
        "and gossip with the swarm.",
    )
    bootstrap = commands.add_parser(
        Command.BOOTSTRAP, help="run a DHT-only entry point for public swarms", epilog=_PRECEDENCE,
        description="Run a DHT-only entry point for public swarms: no training and no gossip. Other nodes pass "
        "its full multiaddr (printed at start) to --peers.",
    )
    for command, parser in ((Command.NODE, node), (Command.JOIN, join), (Command.BOOTSTRAP, bootstrap)):
        _add_config_flag(parser)
        sections = {title: parser.add_argument_group(title) for title in ("general", *_SECTIONS.values())}
        for setting in settings_for(command):
            section = _SECTIONS.get(setting.key.partition(".")[0], "general")
            required = command == Command.JOIN and setting.key == "network.initial_peers"
            _add_setting_flag(sections[section], setting, required_note=required)
        parser.set_defaults(run=_run_node if command in NODE else _run_bootstrap)

    status = commands.add_parser(
        Command.STATUS, help="report a running node", epilog=_PRECEDENCE,
        description="Report a running node from its monitor's JSON API: peer id, swarm, multiaddrs, peers, "
        "step, round, bytes sent and received, errors. Without --url it asks the monitor at "
        "http://MONITOR-HOST:MONITOR-PORT.",
    )
    _add_monitor_target(status)
    status.add_argument("--json", action="store_true",
                        help="print one JSON object: peer_id, swarm, maddrs, peers, step, round, bytes_sent, "
                        "bytes_received, errors")
    status.set_defaults(run=_run_status)

    evaluate = commands.add_parser(
        Command.EVAL, help="validation loss of the swarm-average model, asked of a running node", epilog=_PRECEDENCE,
        description="Ask a running node to pull every live peer's current parameters, average them uniformly "
        "with its own and evaluate the average on its validation split (POST /api/eval/average); print that "
        "loss next to the node's own latest validation loss, and which peers were in and out. Takes seconds "
        "(a peer that does not answer costs up to 30 s). Without --url it asks the monitor at "
        "http://MONITOR-HOST:MONITOR-PORT.",
    )
    _add_monitor_target(evaluate)
    evaluate.add_argument("--timeout", type=_number(float, lo=1.0), default=300.0, metavar="SECONDS",
                          help="how long to wait for the node's answer (default 300)")
    evaluate.add_argument("--save", action="store_true",
                          help="the node also writes the average model to swarm-average.safetensors in its data "
                          "directory (atomically; the previous one is kept as swarm-average.safetensors.prev)")
    evaluate.add_argument("--json", action="store_true",
                          help="print the node's JSON answer: loss, self, peers (peer_id, step, self), failed "
                          "(peer id -> reason), min_step, max_step, elapsed_s, saved, save_error, "
                          "local (val_loss, val_step, loss, step)")
    evaluate.set_defaults(run=_run_eval)

    doctor = commands.add_parser(
        Command.DOCTOR, help="check whether peers can reach a node, through what, and how fast", epilog=_PRECEDENCE,
        description="Check a node's reachability and print a verdict (reachable directly, through relays, not "
        "reachable) with one line of advice per problem: its observed public address, whether peers can dial it "
        "directly, the relays it holds slots at and whether their circuits carry model-sized exchanges, its own "
        "relay service's limits, and the latency and goodput to each neighbour. Without --peers it asks a running "
        "node (its monitor at http://MONITOR-HOST:MONITOR-PORT, or --url). With --peers it checks before joining: "
        "a throwaway p2pd with this machine's --listen/--announce asks those peers to dial it back and reserves at "
        "the relays (--relays, else the peers). docs/deploy.md says what each answer means.")
    _add_monitor_target(doctor)
    joining = doctor.add_argument_group("before joining (instead of asking a running node)")
    for key in ("network.initial_peers", "network.relays", "network.listen", "network.announce",
                "network.reachability"):
        _add_setting_flag(joining, SETTINGS_BY_KEY[key])
    doctor.add_argument("--timeout", type=_number(float, lo=1.0), default=120.0, metavar="SECONDS",
                        help="how long the checks may take (default 120)")
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON object: the node's report (peer_id, mode, reach, observed, relays, "
                        "relay_service, redetected, neighbours) with the verdict and the advice lines")
    doctor.set_defaults(run=_run_doctor)


def _add_monitor_target(parser: argparse.ArgumentParser) -> None:
    """The flags that find a running node (`status`, `eval`): its monitor's port and host, or --url;
    and its monitor token (from its data dir, or --token)."""
    _add_config_flag(parser)
    target = parser.add_mutually_exclusive_group()
    _add_setting_flag(target, SETTINGS_BY_KEY["monitor.port"], help="TCP port of the node's monitor page")
    target.add_argument("--url", help="monitor URL of the node, e.g. http://127.0.0.1:7690 (instead of "
                        "--monitor-host/--monitor-port)")
    _add_setting_flag(parser, SETTINGS_BY_KEY["monitor.host"], help="host of the node's monitor page")
    _add_setting_flag(parser, SETTINGS_BY_KEY["data_dir"], help="the node's data directory, where its monitor "
                      "token is (monitor.token)")
    parser.add_argument("--token", help="the node's monitor token (default: read from <data-dir>/monitor.token; "
                        "a node's POST endpoints need it)")


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config file whose keys are those of docs/cli.md (env {ENV_CONFIG_FILE}); "
                        "MURMUR_* variables and flags override it")


def _add_setting_flag(
    container: argparse._ActionsContainer, setting: Setting, required_note: bool = False, help: str | None = None
) -> None:
    """A flag whose default is SUPPRESS, so the namespace holds only the flags the user gave."""
    choices = f"; one of: {', '.join(setting.kind.choices)}" if isinstance(setting.kind, Choice) else ""
    note = "required: at least one, from this flag, the env var or the config file; " if required_note else ""
    help_text = (f"{help or setting.help}{choices} ({note}default: {default_in_words(setting)}; "
                 f"env {setting.env}; config key {setting.key})").replace("%", "%%")
    common: dict[str, Any] = {"dest": setting.dest, "default": argparse.SUPPRESS, "help": help_text}
    if isinstance(setting.kind, Boolean):
        container.add_argument(setting.flag, action=argparse.BooleanOptionalAction, **common)
    elif isinstance(setting.kind, Multiaddrs):
        container.add_argument(setting.flag, action="extend", nargs="+", metavar=setting.metavar, **common)
    else:
        container.add_argument(setting.flag, metavar=setting.metavar, **common)


def _topology_spec(args: argparse.Namespace, name: str) -> TopologySpec:
    if name == "custom" and not args.edges:
        raise UsageError("the custom topology needs --edges, e.g. --edges 0-1,1-2,2-0")
    return TopologySpec(name, weights=args.weights, degree=args.degree, seed=args.topology_seed,
                        rows=args.rows, edges=args.edges or ())


def _run_topology(args: argparse.Namespace) -> int:
    from node.cli.reports import print_topology

    with _values_checked():
        topology = build_topology(_topology_spec(args, args.name), args.peers)
    print_topology(topology, as_json=args.json)
    return 0


def _run_sim(args: argparse.Namespace) -> int:
    from gossip.memory import LinkModel
    from gossip.mixing import MixingRule
    from gossip.sim import SimConfig, simulate
    from node.cli.reports import print_sim

    bandwidth = args.bandwidth_mbit * 1e6 / 8 if args.bandwidth_mbit else float("inf")
    with _values_checked():
        config = SimConfig(
            peers=args.peers, topology=_topology_spec(args, args.topology), rounds=args.rounds, dim=args.dim,
            drop=args.drop, churn=args.churn, codec=args.codec, seed=args.seed,
            link=LinkModel(latency_s=args.latency_ms / 1000, bandwidth_bytes_per_s=bandwidth),
            rule=MixingRule(kind=args.mixing, tau=args.tau, trim=args.trim),
        )
        build_topology(config.topology, config.peers)  # a bad combination fails here, before round 1
    print_sim(config, simulate(config), as_json=args.json)
    return 0


def _resolve(args: argparse.Namespace, env: Mapping[str, str]) -> ResolvedConfig:
    """Defaults < config file < environment < flags, for the settings of `args.command`."""
    settings = settings_for(args.command)
    layers = []
    config_file = args.config if args.config is not None else env.get(ENV_CONFIG_FILE, "").strip() or None
    if config_file is not None:
        source = "--config" if args.config is not None else ENV_CONFIG_FILE
        layers.append(read_config_file(Path(config_file).expanduser(), source))
    layers.append(read_environment(env, settings))
    given = vars(args)
    layers.append(read_flags({setting: given[setting.dest] for setting in settings if setting.dest in given}))
    return merge_layers(*layers)


def node_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> NodeConfig:
    """The checked config of a parsed `node`, `join` or `bootstrap` command line; raises ConfigError."""
    resolved = _resolve(args, env)
    if args.command == Command.JOIN and not resolved.config.network.initial_peers:
        raise ConfigError("no peer to join through: give --peers MULTIADDR (or MURMUR_PEERS, or "
                          "network.initial_peers in the config file)")
    network = resolved.config.network
    if network.reachability == "private" and network.serves_relay(bootstrap=args.command == Command.BOOTSTRAP):
        raise ConfigError(f"{resolved.source('network.reachability')}: a relay must be reachable directly, so it "
                          "cannot run with --reachability private (add --no-relay-service)")
    check_environment(resolved, swarm=args.command in NODE, monitor=args.command in NODE)
    if args.command == Command.NODE:
        _check_founders_recipe(resolved)
        return resolved.config
    if args.command == Command.JOIN:
        return _with_invite(resolved)
    return resolved.config


def _with_invite(resolved: ResolvedConfig) -> NodeConfig:
    """A joiner's config with its invite's swarm name and founder (which must agree with --swarm and
    --founder where those are given too)."""
    config = resolved.config
    if config.invite is None:
        return config
    from node.net.founder import parse_invite

    try:
        invite = parse_invite(config.invite)
    except ValueError as exc:
        raise ConfigError(f"{resolved.source('invite')}: {exc}") from None
    for key, given, wanted in (("swarm", config.swarm, invite.swarm), ("founder", config.founder, invite.founder)):
        if key in resolved.sources and given != wanted:
            raise ConfigError(f"{resolved.source(key)}: {given!r} differs from the invite's {wanted!r} "
                              f"({resolved.source('invite')}); give one of them")
    return dataclasses.replace(config, swarm=invite.swarm, founder=invite.founder)


def _check_founders_recipe(resolved: ResolvedConfig) -> None:
    """A founder's recipe must be one every node accepts (node.swarm.recipe's bounds): refuse it here,
    naming the setting, rather than publish a document its own swarm would refuse."""
    from node.swarm.recipe import SETTING_OF_FIELD, RecipeInvalid, field_at_fault, swarm_document

    config = resolved.config
    if config.training.trains_model:  # the flags' bounds, without reading a model's or tokenizer's files here
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, model="moe",
                                                                            tokenizer=None))
    try:
        swarm_document(config, 0.0)
    except RecipeInvalid as exc:
        fault = field_at_fault(exc)
        key = SETTING_OF_FIELD.get(fault[0]) if fault is not None else None
        if fault is None or key is None:
            raise ConfigError(f"the swarm's recipe: {exc}") from None
        raise ConfigError(f"{resolved.source(key)}: {fault[1]}") from None


def parse_node_config(argv: Sequence[str], env: Mapping[str, str]) -> NodeConfig:
    """The config a `murmur node|join|bootstrap ...` command line would run with, without running it.

    `argv` starts with the command, e.g. ["join", "--peers", ADDR]; `env` stands for os.environ.
    Every bad flag or value raises ConfigError with the line `murmur` would print.
    """
    args = build_parser(_ConfigErrorParser).parse_args(argv)
    if args.command not in DAEMONS:
        raise ConfigError(f"murmur {args.command} does not run a node")
    return node_config_from_args(args, env)


def status_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The monitor URL a parsed `status` or `eval` command line asks; raises ConfigError."""
    if args.url is not None:
        if SETTINGS_BY_KEY["monitor.host"].dest in vars(args):
            raise ConfigError("--monitor-host cannot be combined with --url")
        url = urllib.parse.urlsplit(args.url)
        try:
            url.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as exc:
            raise ConfigError(f"--url: {args.url!r} has a bad port: {exc}") from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"--url: {args.url!r} is not an http(s) URL like http://127.0.0.1:7690")
        return str(args.url).rstrip("/")
    resolved = _resolve(args, env)
    if resolved.config.monitor.port == 0:
        raise ConfigError(f"{resolved.source('monitor.port')}: port 0 means the node picked a free port; "
                          "pass the port it reported with --monitor-port, or --url")
    return resolved.config.monitor.url


def _run_node(args: argparse.Namespace) -> int:
    config = node_config_from_args(args, os.environ)
    from node.runtime.serve import run_node

    exit_status: int = run_node(config, founding=args.command == Command.NODE)
    return exit_status


def _run_bootstrap(args: argparse.Namespace) -> int:
    config = node_config_from_args(args, os.environ)
    from node.runtime.serve import run_bootstrap

    exit_status: int = run_bootstrap(config)
    return exit_status


def monitor_token(args: argparse.Namespace, env: Mapping[str, str], url: str) -> str | None:
    """The monitor token a parsed `status`, `eval` or `doctor` command line sends: --token, else the one in the
    data directory. The data directory's token goes only to a loopback URL unless the data directory
    was named (flag, environment, config file): a node elsewhere must not learn this machine's token."""
    if args.token is not None:
        return str(args.token).strip()
    resolved = _resolve(args, env)
    if "data_dir" in resolved.sources:
        return _read_token(resolved.config.data_dir)
    return _loopback_token(url, resolved.config.data_dir)


def _loopback_token(url: str, data_dir: Path) -> str | None:
    """The token in `data_dir`, if `url` is on this machine's loopback (else None: not sent elsewhere)."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in ("localhost", "::1") and not host.startswith("127."):
        return None
    return _read_token(data_dir)


def _read_token(data_dir: Path) -> str | None:
    try:
        return (data_dir / MONITOR_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def _run_status(args: argparse.Namespace) -> int:
    url = status_url(args, os.environ)
    from node.cli.status import run_status

    return run_status(url, args.json, token=monitor_token(args, os.environ, url))


def _run_eval(args: argparse.Namespace) -> int:
    url = status_url(args, os.environ)
    from node.cli.eval import run_eval

    return run_eval(url, args.json, args.timeout, save=args.save, token=monitor_token(args, os.environ, url))


def _run_doctor(args: argparse.Namespace) -> int:
    given = vars(args)
    if SETTINGS_BY_KEY["network.initial_peers"].dest not in given:
        url = status_url(args, os.environ)
        from node.cli.doctor import run_doctor_node

        return run_doctor_node(url, args.json, args.timeout, token=monitor_token(args, os.environ, url))
    if args.url is not None or SETTINGS_BY_KEY["monitor.port"].dest in given:
        raise UsageError("--peers checks before joining; --url and --monitor-port ask a running node: give one or the other")
    config = _resolve(args, os.environ).config
    from node.cli.doctor import run_doctor_before_joining

    return run_doctor_before_joining(config, args.json, args.timeout)


@contextlib.contextmanager
def _values_checked() -> Iterator[None]:
    """Turn the ValueError of a config object built from flags into a usage error."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (UsageError, ConfigError) as exc:
        print(f"murmur {args.command}: error: {exc}", file=sys.stderr)
        return 2


"""``tvm-rammer tune MODEL.onnx --target TAG --trials N --work-dir DIR [--rpc-tracker H:P --rpc-key K]``.

Runs MetaSchedule over the model's operators and writes its JSON database to ``--work-dir``; pass
that directory to ``compile``/``inspect``/``bench`` as ``--tuning-db DIR``.
"""


def register(sub, add_common, make_config):
    """Add the ``tune`` subcommand to the ``tvm-rammer`` parser."""
    p = sub.add_parser("tune", help="MetaSchedule-tune the model's operators (needs a GPU or an RPC "
                                    "tracker); writes a database for --tuning-db")
    add_common(p)
    p.add_argument("--trials", type=int, default=2000, help="global trial budget (default: %(default)s)")
    p.add_argument("--work-dir", required=True, help="where the MetaSchedule database is written")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on the devices of this RPC tracker instead of the local GPU")
    p.add_argument("--rpc-key", default=None, help="device key registered with the RPC tracker")
    p.set_defaults(func=lambda args: cmd_tune(args, make_config))


def cmd_tune(args, make_config) -> int:
    from .tune import RPCTracker, tune

    rpc = None if args.rpc_tracker is None else RPCTracker.parse(args.rpc_tracker, args.rpc_key)
    if rpc is None and args.rpc_key is not None:
        raise ValueError("--rpc-key is only used with --rpc-tracker HOST:PORT")
    tune(args.model, args.target, args.trials, args.work_dir, rpc=rpc, config=make_config(args))
    return 0

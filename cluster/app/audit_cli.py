"""`pdserve audit verify`: check an audit log's hash chain (router/ingress/gateway/audit_log.py)."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    au = sub.add_parser("audit", help="the audit log (audit.dir)")
    au_sub = au.add_subparsers(dest="audit_command", required=True)
    av = au_sub.add_parser("verify", help="check the hash chain of an audit log directory (or one file) and "
                                          "its end against the directory's HEAD; names the first record that "
                                          "was edited, removed or cut off")
    av.add_argument("path", nargs="?", help="default: audit.dir's default, $XDG_STATE_HOME/pdserve/audit "
                                            "(~/.local/state/pdserve/audit)")
    av.add_argument("--anchor", metavar="SEQ:HASH", help="a head kept elsewhere (an earlier `chain head`): "
                                                         "the log must still hold that record, with that hash")
    av.set_defaults(func=audit_verify)


def audit_verify(args) -> int:
    from cluster.config.front_door import state_path  # noqa: PLC0415
    from router.ingress.gateway.audit_log import verify  # noqa: PLC0415

    anchor = None
    if args.anchor:
        seq, _, digest = args.anchor.partition(":")
        if not (seq.isdigit() and len(digest) == 64):
            print(f"pdserve audit verify: --anchor wants SEQ:HASH (a record's seq and its 64-hex hash), got "
                  f"{args.anchor!r}", file=sys.stderr)
            return 2
        anchor = (int(seq), digest)
    path = state_path(args.path, "audit")
    result = verify(path, anchor=anchor)
    if not result.ok:
        print(f"FAIL after {result.records} good records: {result.error}", file=sys.stderr)
        return 1
    past = (f"; {result.unanchored} record(s) past HEAD (a writer crash before HEAD moved: anchored when it "
            f"restarts)" if result.unanchored else "")
    print(f"OK: {result.records} records in {result.files} file(s) of {path}; chain head {result.head}{past}")
    return 0

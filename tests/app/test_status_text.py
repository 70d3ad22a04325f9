"""`pdserve status`'s replica table (cluster/app/status_cli.py), from the loads the replicas report."""

from cluster.app.status_cli import _print_replicas


def load(role: str, deployment: str, **feed) -> dict:
    return {"role": role, "deployment": deployment, "total_blocks": 100, "free_blocks": 75, "running": 2,
            "waiting": 1, "importing": 1, "last_step_ms": 12.5, "age_s": 0.4, "router_feed": feed}


def test_the_replica_table_names_each_role_and_a_flipped_replica_s_deployment(capsys):
    _print_replicas({"p-1": load("prefill", "prefill"),
                     "p-2": load("decode", "prefill", lag_last_s=0.004, lag_max_s=0.02)})
    header, plain, flipped = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["replica", "role"]
    assert plain.split() == ["p-1", "prefill", "25/100", "2", "2", "12.50", "0.4", "-"]
    assert flipped.split() == ["p-2", "decode", "(of", "prefill)", "25/100", "2", "2", "12.50", "0.4", "4", "(20)"]

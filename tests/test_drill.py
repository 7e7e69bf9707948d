"""The multi-host drill (scripts/drill.sh, docs/many-hosts.md).

- Its accounting (scripts/drill/ledger.py: what counts as lost or duplicated), unit tier.
- The drill itself: three hosts as network namespaces, four scenarios, every line lost 0 / duplicated 0.
  Its own tier: it needs root and takes minutes, so it runs only with RELAY_DRILL=1 (`make drill` runs
  the script directly); without root it is skipped, as the script skips itself.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from drill import ledger  # noqa: E402

LINE = re.compile(
    r"^scenario (?P<name>\w+): items (?P<items>\d+), final (?P<final>\d+), usage events (?P<events>\d+), "
    r"lost (?P<lost>\d+), duplicated (?P<dup>\d+), recovered in (?P<s>[\d.]+) s$"
)
HOSTS = {"drill-a1": "10.231.0.11", "drill-a2": "10.231.0.12"}


def row(i, batch="b1", state="completed", attempt=1, owner="drill-a1", events=1, finishes=1, peer="10.231.0.11"):
    return ledger.ItemRow(f"item-{i}", batch, state, attempt, owner, events, finishes, peer)


def tally(rows, api=None, expected=3):
    ids = [str(i) for i in range(expected)]
    return ledger.account({"b1": expected}, rows, {"b1": ids if api is None else api}, {"b1": ids}, HOSTS)


# --- the accounting ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_clean_scenario_counts_nothing_lost_or_duplicated():
    t = tally([row(0), row(1, owner="drill-a2", peer="10.231.0.12"), row(2)])
    assert (t.items, t.final, t.events, t.lost, t.duplicated) == (3, 3, 3, 0, 0)
    line = t.line("kill_host", 12.34)
    assert LINE.match(line).groupdict() == {
        "name": "kill_host",
        "items": "3",
        "final": "3",
        "events": "3",
        "lost": "0",
        "dup": "0",
        "s": "12.3",
    }


@pytest.mark.unit
def test_an_item_never_finished_or_never_created_is_lost():
    t = tally([row(0), row(1, state="running")], api=["0"])
    assert (t.final, t.lost, t.duplicated) == (1, 2, 0)
    assert any("missing from the results" in n for n in t.notes)


@pytest.mark.unit
def test_a_completed_item_without_its_usage_event_or_its_result_is_lost():
    assert tally([row(0), row(1, events=0), row(2)]).lost == 1
    assert tally([row(0), row(1), row(2)], api=["0", "1"]).lost == 1


@pytest.mark.unit
def test_a_discarded_item_is_final_but_lost():
    t = tally([row(0), row(1, state="discarded"), row(2)])
    assert (t.final, t.lost) == (3, 1)


@pytest.mark.unit
def test_billed_twice_finished_twice_or_returned_twice_is_duplicated():
    assert tally([row(0, events=2), row(1), row(2)]).duplicated == 1
    assert tally([row(0, finishes=2), row(1), row(2)]).duplicated == 1
    assert tally([row(0), row(1), row(2)], api=["0", "1", "2", "2"]).duplicated == 1


@pytest.mark.unit
def test_a_result_written_by_a_host_whose_claim_was_taken_is_a_late_write_let_through():
    """The item was finished by drill-a1's claim, but the stored result came from drill-a2's call: the cut
    host wrote after its claim was taken. That is counted, and said."""
    t = tally([row(0), row(1, owner="drill-a1", peer="10.231.0.12"), row(2)])
    assert (t.lost, t.duplicated) == (0, 1)
    assert "finished by drill-a1, result from 10.231.0.12" in t.notes[0]


# --- the drill ---------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_drill_loses_and_duplicates_nothing_on_any_scenario():
    if os.environ.get("RELAY_DRILL") != "1":
        pytest.skip("the drill tier: set RELAY_DRILL=1 (make drill runs it directly)")
    if os.geteuid() != 0:
        pytest.skip("the drill needs root (network namespaces)")
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "drill.sh")], capture_output=True, text=True, timeout=1200, check=False
    )
    if run.stdout.startswith("drill: skipped:"):
        pytest.skip(run.stdout.strip())
    lines = {m["name"]: m for m in map(LINE.match, run.stdout.splitlines()) if m}
    assert set(lines) == {"kill_host", "partition", "redis_restart", "postgres_restart"}, run.stdout + run.stderr
    for name, m in lines.items():
        assert (m["lost"], m["dup"]) == ("0", "0"), f"{name}: {m.group(0)}\n{run.stderr[-4000:]}"
        assert int(m["items"]) == int(m["final"]) == int(m["events"]) > 0, m.group(0)
    assert run.returncode == 0, run.stderr[-4000:]

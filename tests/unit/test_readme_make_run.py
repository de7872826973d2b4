"""The README's "`make run` prints" block is what `make run` prints: its devices and the first
steps of its walkthrough, as `e2e.devcluster` writes them; and the VMs the README's and the dev
cluster page's walkthroughs apply are the objects make run writes."""

from pathlib import Path

from e2e import devcluster

REPO = Path(__file__).resolve().parents[2]


def printed_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    after = text[text.index("`make run` prints:"):]
    return after.split("```\n", 2)[1].splitlines()


def test_the_readme_lists_every_device_make_run_shows():
    rows = [line.split() for line in printed_block() if line.startswith("pci-")]
    assert len(rows) == devcluster.EXPECTED_DEVICES, rows
    assert [devcluster.FIRST_GPU, devcluster.GPU_NODE, "0000:3b:00.0"] in [row[:3] for row in rows]


def test_the_readme_shows_the_first_steps_make_run_prints_as_printed():
    said = devcluster.hints(Path("/work/main/.devcluster/kubeconfig"), Path("kubectl"), dra=False,
                            containers=Path("/tmp/kl/containers.jsonl"))  # fmt: skip
    steps = [line for line in said if line.startswith("  kubectl ")]
    shown = [line for line in printed_block() if line.startswith("  kubectl ")]
    assert shown and shown == steps[: len(shown)], shown
    assert "Use the cluster from another shell:" in printed_block()


def test_the_vms_the_readme_and_the_dev_cluster_page_apply_are_those_make_run_writes():
    # The walkthrough's here-documents, as the integration test extracts and runs them.
    from tests.integration.test_make_run import applied, readme_and_page

    for dra in (False, True):
        heredocs = applied(readme_and_page(dra))
        assert len(heredocs) == 2, heredocs  # the README's and the page's
        assert all(objects == devcluster.tenant_objects(dra) for objects in heredocs), (dra, heredocs)

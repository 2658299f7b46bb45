"""A registry for tests that serve the whole app: the tiny models, plus the tiny target registered
under the name of the model the shipped results were measured on (assets/bench), with that model's
heads registered, so the tabs that open on shipped results (Deploy? prices them from their models)
reach the model loader as they do in the real app, in milliseconds instead of loading the real
model, and Explore's first look starts on its own strategy."""

import json
from pathlib import Path

SHIPPED_MODEL = "smollm2-135m"  # the model assets/bench's summary.json files name
# its heads' registry entry, so that Explore's first look (the heads on SHIPPED_MODEL) starts on its
# own strategy as in the app; registered, never loaded (their shapes are the real model's)
HEADS = Path(__file__).resolve().parent.parent / "assets" / "heads" / "smollm2-135m-mtp"


def registry_with_shipped_model(tiny_registry: Path, folder: Path) -> Path:
    """A models.yaml in `folder`: `tiny_registry`'s models (paths made absolute) and SHIPPED_MODEL,
    the tiny target under the shipped model's name."""
    data = json.loads(tiny_registry.read_text())
    for model in data["models"]:
        model["sources"] = [
            {**s, "path": str(tiny_registry.parent / s["path"])} if s.get("path") else s for s in model["sources"]
        ]
    target = next(m for m in data["models"] if m["id"] == data["defaults"]["cpu"])
    shipped_heads = {"id": f"{SHIPPED_MODEL}-mtp", "label": "The shipped heads' entry", "base": SHIPPED_MODEL}
    data["models"].append(
        {
            "id": SHIPPED_MODEL,
            "label": "Tiny, as the shipped model",
            "sources": target["sources"],
            "heads": [shipped_heads["id"]],
        }
    )
    data.setdefault("heads", []).append({**shipped_heads, "path": str(HEADS)})
    path = folder / "models.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path

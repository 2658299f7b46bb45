"""What a tab draws when a user first opens it, instead of on page load: a hidden tab costs
nothing until someone looks at it (Deploy? loads models to price its strategies), and the page's
first paint waits on none of it. A tab's builder hands its handlers to the app, which runs each
once per session, the first time the tab is selected; coming back to the tab redraws nothing."""

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr


@dataclass(frozen=True)
class OnOpen:
    fn: Callable  # the inputs' values → the outputs' values (one value for one output)
    inputs: list
    outputs: list


def on_first_open(tab: gr.Tab, handlers: list[OnOpen]) -> None:
    """Wire each handler to `tab`'s first selection in a session (inside the app's Blocks)."""
    for handler in handlers:
        opened = gr.State(False)
        tab.select(_once(handler), [opened, *handler.inputs], [opened, *handler.outputs], api_visibility="private")


def _once(handler: OnOpen) -> Callable:
    """The handler, run while `opened` is false; it stays false where the handler fails, so the
    next visit tries again."""
    many = len(handler.outputs) > 1

    def first_open(opened: bool, *values):
        if opened:
            return (True, *[gr.skip()] * len(handler.outputs))
        drawn = handler.fn(*values)
        return (True, *drawn) if many else (True, drawn)

    first_open.__name__ = f"first_open_{handler.fn.__name__}"  # names the handler in logs and tests
    return first_open

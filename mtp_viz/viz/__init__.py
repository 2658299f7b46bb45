"""Pure functions from traces to HTML, figures and tables. No model, no Gradio."""

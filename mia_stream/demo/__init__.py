"""``mia-stream demo``: the end-to-end demo on the embedded model (``run``) and the pipeline it drives."""


def main(argv=None) -> int:
    from mia_stream.demo.run import main as run_main

    return run_main(argv)

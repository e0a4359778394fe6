from toolkit.orphans import follow_launcher

follow_launcher()  # a rank of `toolkit launch`: before anything else, so that it cannot outlive its launcher

from toolkit.cli import run  # noqa: E402

run()

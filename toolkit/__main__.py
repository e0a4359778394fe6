from toolkit.errors import end_restart_after_final_stop
from toolkit.process.orphans import follow_launcher

# a rank of `toolkit launch`: before anything else, so that it cannot outlive its launcher, and so that a restart
# after a user's mistake or a non-finite stop costs no loading
follow_launcher()
end_restart_after_final_stop()

from toolkit.cli import run  # noqa: E402

run()

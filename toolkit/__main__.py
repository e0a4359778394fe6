from toolkit.errors import end_restart_after_user_error
from toolkit.orphans import follow_launcher

# a rank of `toolkit launch`: before anything else, so that it cannot outlive its launcher, and so that a restart
# after a user's mistake costs no loading
follow_launcher()
end_restart_after_user_error()

from toolkit.cli import run  # noqa: E402

run()

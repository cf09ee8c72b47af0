# The notebooks' kernels (make env copies this file into .venv/etc/ipython/, where every kernel of the
# environment reads it). ipykernel warns on every start that its sockets use TCP without encryption; the
# kernels papermill and the book build start listen on this machine only and check every message against
# the key of a connection file only its user can read. The warning says nothing about the chapter being
# run, so it is dropped; every other message of the kernel is kept.
import logging


class _WithoutTcpWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(_WithoutTcpWarning())

# The notebooks' kernels (make env copies this file into .venv/etc/ipython/, where every kernel of the
# environment reads it). Two messages say nothing about the chapter being run, so they are dropped:
# - ipykernel warns on every start that its sockets use TCP without encryption; the kernels papermill and
#   the book build start listen on this machine only and check every message against the key of a
#   connection file only its user can read;
# - jupyter_client interrupts a kernel before it asks it to shut down, and a kernel caught between two
#   messages logs "KeyboardInterrupt caught in kernel" as an error, though the notebook has finished. An
#   interrupt while a cell runs is not this message: it stops the cell and shows in the notebook.
# Every other message of the kernel is kept.
import logging

_DROPPED = ("running over TCP without encryption", "KeyboardInterrupt caught in kernel")


class _WithoutNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _DROPPED)


logging.getLogger("IPKernelApp").addFilter(_WithoutNoise())

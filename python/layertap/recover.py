"""Placeholder: recovery bindings are being written."""


def recover(path):
    raise NotImplementedError

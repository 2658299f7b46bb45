"""Errors caused by what a user asked for. The CLI and UI show their message, never a traceback."""


class UserError(ValueError):
    """Bad input: an unknown name, an invalid setting, an impossible request."""


class UnknownModelError(UserError):
    pass


class UnknownStrategyError(UserError):
    pass


class IncompatibleDraftError(UserError):
    pass


class InvalidSettingsError(UserError):
    pass


class InvalidTraceError(UserError):
    pass

HOOKS: list = []

"""Framework hooks: serving engines that load by R-Fork and become seeds (SGLang)."""

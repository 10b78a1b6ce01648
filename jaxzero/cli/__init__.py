"""The programs: each module is one `python -m jaxzero.<program>` command and its console script
(`jaxzero-train`, ...), wiring the library's layers below; nothing in the package imports them. The
flat `jaxzero/<program>.py` modules only run these (`python -m jaxzero.train` keeps working)."""

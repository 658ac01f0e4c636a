"""package_file: finds a data file of an installed package without importing it, and names what is missing."""

import pytest

from ringtune.models.checkpoints.package_files import package_file


def test_finds_a_file_of_an_installed_package():
    path = package_file("json", "json", "decoder.py")
    assert path.name == "decoder.py" and path.is_file()


def test_missing_package_names_the_default_install_command():
    with pytest.raises(
        FileNotFoundError,
        match=r"^the package 'no-such-pkg' \(module no_such_pkg_xyz\) is not installed; pip install no-such-pkg$",
    ):
        package_file("no_such_pkg_xyz", "no-such-pkg", "data.bin")


def test_missing_file_repeats_only_a_given_hint():
    with pytest.raises(FileNotFoundError, match=r"^nope\.bin not found in \[.*\] of package 'json'$"):
        package_file("json", "json", "nope.bin")
    with pytest.raises(FileNotFoundError, match=r"of package 'json'; reinstall it with x$"):
        package_file("json", "json", "nope.bin", install_hint="install it with x")

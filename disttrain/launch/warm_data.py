"""Imported by the fork server before it forks ranks: the default data's images and labels read there once
(``digits_arrays``), so that no rank of a digits run spends CPU reading them again."""

from disttrain.data.digits import digits_arrays

digits_arrays()

"""The built-in recipes and gate policies, installed as the package kvconvert.recipes (pyproject's
package-dir maps this folder) so that an installed kvconvert finds them with importlib.resources
(kvconvert.resources). Data only: this file makes the folder a regular package, nothing imports it."""

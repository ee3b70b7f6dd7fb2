# The old arm of a server A/B (bench/server/run41.sh lays .oldfiles/ over a copy of this tree):
# every file under services/ that changed since BASE, as it was at BASE. Run here, before the
# device call (the device's copy has no git history). Usage: bash bench/server/oldfiles.sh <BASE>
set -eu
base=${1:?usage: bash bench/server/oldfiles.sh <BASE commit>}
rm -rf .oldfiles
for f in $(git diff --name-only "$base" HEAD -- services/); do
  mkdir -p ".oldfiles/$(dirname "$f")"
  if git cat-file -e "$base:$f" 2>/dev/null; then
    git show "$base:$f" > ".oldfiles/$f"
  else
    echo "oldfiles: $f is new since $base; the old arm keeps this tree's" >&2
  fi
done
find .oldfiles -type f | sort

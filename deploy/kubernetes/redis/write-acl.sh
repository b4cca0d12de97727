#!/bin/sh
# Writes Redis's ACL file for one job from the passwords in the Secret `cohort-redis`, at
# every start of the Redis pod, so the Secret is the one place they live (users created
# later with ACL SETUSER, such as per-worker credentials, last until Redis restarts).
#
#   default                   the admin password: `cohort reset`, `cohort acl --worker ...`
#   cohort-JOB-coordinator    \
#   cohort-JOB-worker          } the roles of `cohort acl --job JOB` (docs/identity.md)
#   cohort-JOB-viewer         /
#   cohort-JOB-torchrun       only with a torchrun password: `cohort acl --role torchrun`,
#                             torchrun's agents (membership, the rendezvous and its store).
set -eu
: "${COHORT_JOB:?}" "${COHORT_REDIS_ADDRESS:?}" "${REDIS_ADMIN_PASSWORD:?}"
: "${COHORT_ACL_COORDINATOR_PASSWORD:?}" "${COHORT_ACL_WORKER_PASSWORD:?}"
: "${COHORT_ACL_VIEWER_PASSWORD:?}"
out="${ACL_FILE:-/acl/users.acl}"

sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

# `cohort acl` prints ACL SETUSER lines for redis-cli; an ACL file takes the same rules
# after `user NAME`, unquoted (Redis splits its lines at spaces and joins selectors itself).
torchrun=""
if [ -n "${COHORT_ACL_TORCHRUN_PASSWORD:-}" ]; then torchrun="--role torchrun"; fi
# shellcheck disable=SC2086 # $torchrun is two words or none
cohort acl --job "$COHORT_JOB" --redis-url "redis://$COHORT_REDIS_ADDRESS" \
    --redis-version "${REDIS_VERSION:-7.2}" \
    --role coordinator --role worker --role viewer $torchrun > "$out.roles"
{
    echo "user default on #$(sha "$REDIS_ADMIN_PASSWORD") ~* &* +@all"
    sed -e 's/^ACL SETUSER /user /' -e 's/"//g' "$out.roles"
} > "$out.tmp"
rm "$out.roles"
mv "$out.tmp" "$out"
echo "wrote the ACL users of job $COHORT_JOB"

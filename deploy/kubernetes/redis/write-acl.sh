#!/bin/sh
# Writes Redis's ACL file for one job from the passwords in the Secret `cohort-redis`, at
# every start of the Redis pod, so the Secret is the one place they live (users created
# later with ACL SETUSER, such as per-worker credentials, last until Redis restarts).
#
#   default                   the admin password: `cohort reset`, `cohort acl --worker ...`
#   cohort-JOB-coordinator    \
#   cohort-JOB-worker          } the roles of `cohort acl --job JOB` (docs/identity.md)
#   cohort-JOB-viewer         /
#   cohort-JOB-torchrun       only with a torchrun password: torchrun's agents keep their
#                             rendezvous and store in the job's keys, so this user may read
#                             and write every key of JOB (and no other job's), but not
#                             flush, list keys or change functions and configuration.
set -eu
: "${COHORT_JOB:?}" "${COHORT_REDIS_ADDRESS:?}" "${REDIS_ADMIN_PASSWORD:?}"
: "${COHORT_ACL_COORDINATOR_PASSWORD:?}" "${COHORT_ACL_WORKER_PASSWORD:?}"
: "${COHORT_ACL_VIEWER_PASSWORD:?}"
out="${ACL_FILE:-/acl/users.acl}"
db="${COHORT_REDIS_ADDRESS##*/}"

sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

# `cohort acl` prints ACL SETUSER lines for redis-cli; an ACL file takes the same rules
# after `user NAME`, unquoted (Redis splits its lines at spaces and joins selectors itself).
cohort acl --job "$COHORT_JOB" --redis-url "redis://$COHORT_REDIS_ADDRESS" \
    --redis-version "${REDIS_VERSION:-7.2}" > "$out.roles"
{
    echo "user default on #$(sha "$REDIS_ADMIN_PASSWORD") ~* &* +@all"
    sed -e 's/^ACL SETUSER /user /' -e 's/"//g' "$out.roles"
    if [ -n "${COHORT_ACL_TORCHRUN_PASSWORD:-}" ]; then
        echo "user cohort-$COHORT_JOB-torchrun on #$(sha "$COHORT_ACL_TORCHRUN_PASSWORD")" \
            "resetkeys resetchannels ~cohort:{$COHORT_JOB}:* -@all +@read +@write +@keyspace" \
            "+@string +@hash +@list +@set +@stream +@transaction +@connection +@scripting" \
            "-@dangerous -function -script|flush -script|kill -scan -select +select|$db"
    fi
} > "$out.tmp"
rm "$out.roles"
mv "$out.tmp" "$out"
echo "wrote the ACL users of job $COHORT_JOB"
